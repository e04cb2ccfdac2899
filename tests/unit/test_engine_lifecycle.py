"""Preempt-and-recompute, aborts, block accounting and input errors on the tiny model."""

import random

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.errors import AdapterNotFoundError, ContextLengthError, InvalidRequestError
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import make_random_adapter, run_to_completion


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(
        tiny_model_dir, tmp_path_factory.mktemp("a") / "a8", rank=8, targets=["q_proj", "down_proj"]
    )


def _engine(model_dir, adapter_dir, **kw):
    cfg = EngineConfig(**{"max_lora_rank": 16, "max_loras": 2, "block_size": 4, **kw})
    return build_engine(model_dir, cfg, {"a8": str(adapter_dir)}, tokenizer=None)


def _requests(seed, n, params, adapters=(None, "a8")):
    rng = random.Random(seed)
    return [
        GenerateRequest(
            f"r{i}", tuple(rng.randrange(320) for _ in range(rng.randint(4, 20))), params, adapters[i % len(adapters)]
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=1234),
    ],
    ids=["greedy", "seeded-sampling"],
)
def test_preempted_requests_resume_exactly(tiny_model_dir, adapter_dir, params):
    reqs = _requests(0, 6, params)
    roomy = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=256)
    expected, _, migrates = run_to_completion(roomy, {0: reqs})
    assert not migrates

    # 6 requests × up to 60 tokens need up to 90 blocks of 4: 40 forces preemptions.
    tight = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=40)
    by_id = {r.request_id: r for r in reqs}
    got, reasons, migrates = run_to_completion(
        tight, {0: reqs}, on_migrate=lambda m: tight.add(by_id[m.request_id].resumed(m))
    )
    assert migrates, "the tight KV cache should have forced a preemption"
    assert any(m.output_token_ids for m in migrates), "no request was preempted mid-generation"
    assert got == expected
    assert set(reasons.values()) == {"length"}
    assert tight.allocator.num_free == 40 and not tight.has_work()

    # nowhere to move them (a lone replica): the scheduler requeues them itself, as nano-vllm's preempt()
    requeuing = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=40, requeue_preempted=True)
    outputs_at_preemption = []
    preempt = requeuing.scheduler._preempt
    requeuing.scheduler._preempt = lambda seq, out: (
        outputs_at_preemption.append(len(seq.output_ids)),
        preempt(seq, out),
    )
    got, reasons, migrates = run_to_completion(requeuing, {0: reqs})
    assert not migrates and requeuing.preemptions == len(outputs_at_preemption) > 0
    assert any(outputs_at_preemption), "no request was preempted mid-generation"
    assert got == expected and set(reasons.values()) == {"length"}
    assert requeuing.allocator.num_free == 40 and not requeuing.has_work()


def test_newest_request_is_preempted(tiny_model_dir, adapter_dir):
    reqs = _requests(1, 3, SamplingParams(max_tokens=60, temperature=0.0), adapters=(None,))
    engine = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=36)
    first = {}
    run_to_completion(engine, {0: reqs[:2], 3: reqs[2:]}, on_migrate=lambda m: first.setdefault("id", m.request_id))
    assert first["id"] == "r2"


def test_mixed_workload_leaves_nothing_behind(tiny_model_dir, adapter_dir):
    engine = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=30, max_num_seqs=4, max_tokens_per_step=24)
    reqs = _requests(2, 12, SamplingParams(max_tokens=30, temperature=0.7, seed=5))
    by_id = {r.request_id: r for r in reqs}
    aborted = set()
    step = 0
    schedule = {0: reqs[:6], 5: reqs[6:]}
    outcomes = {}
    while engine.has_work() or step <= 5:
        for r in schedule.get(step, []):
            engine.add(r)
        if step in (3, 8, 9):  # abort a running one, a waiting one, and an unknown id
            victim = {3: "r1", 8: "r11", 9: "nope"}[step]
            aborted.add(victim)
            for c in engine.abort(victim):
                outcomes[c.request_id] = c.finish_reason
        for c in engine.step():
            if hasattr(c, "seed"):
                engine.add(by_id[c.request_id].resumed(c))
            elif c.finish_reason:
                outcomes[c.request_id] = c.finish_reason
        step += 1
    assert set(outcomes) == set(by_id)
    assert {outcomes["r1"], outcomes["r11"]} == {"abort"}
    assert engine.allocator.num_free == 30
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.model.lora_pool.pinned() == 0


def test_errors_before_compute(tiny_model_dir, adapter_dir, tmp_path):
    engine = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=16, max_model_len=100)
    with pytest.raises(AdapterNotFoundError):
        engine.add(GenerateRequest("x", (1, 2, 3), SamplingParams(), adapter="missing"))
    with pytest.raises(ContextLengthError):
        engine.add(GenerateRequest("x", tuple(range(50)), SamplingParams(max_tokens=60)))
    with pytest.raises(ContextLengthError):  # fits the model, not this KV cache (16 blocks of 4)
        engine.add(GenerateRequest("x", tuple(range(40)), SamplingParams(max_tokens=30)))
    with pytest.raises(InvalidRequestError):
        engine.add(GenerateRequest("x", (), SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.add(GenerateRequest("x", (999,), SamplingParams()))
    for bad in [
        dict(temperature=-1),
        dict(top_p=0),
        dict(max_tokens=0),
        dict(top_k=-2),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=("",)),
        dict(logprobs=99),
    ]:
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert engine.steps == 0 and not engine.has_work()
