"""Failure isolation inside one engine step (the tiny random Llama, no Ray): a request
whose logits turn non-finite, or whose adapter fails to load into a pool slot, ends
alone with an ErrorChunk; the requests batched with it finish exactly as they do alone,
and nothing stays allocated."""

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import ErrorChunk, GenerateRequest, SamplingParams
from tests.support.helpers import make_random_adapter

PROMPTS = {"a": [5, 9, 17, 3], "b": [44, 2, 8], "c": [100, 7, 7, 19, 21]}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_random_adapter(tiny_model_dir, root / name, rank=4, targets=["q_proj", "down_proj"], seed=i))
        for i, name in enumerate(["x", "y", "broken"])
    }


def _engine(tiny_model_dir, adapters):
    return build_engine(
        tiny_model_dir, EngineConfig(num_kv_blocks=64, block_size=4, max_loras=4), adapters, tokenizer=None
    )


def _requests(hostile_params: SamplingParams) -> list[GenerateRequest]:
    victim = SamplingParams(max_tokens=8, temperature=0.8, seed=11)
    return [
        GenerateRequest("a", tuple(PROMPTS["a"]), victim, "x"),
        GenerateRequest("b", tuple(PROMPTS["b"]), victim, None),
        GenerateRequest("c", tuple(PROMPTS["c"]), hostile_params, "broken"),
    ]


def _run(core, requests) -> dict:
    out = {r.request_id: [] for r in requests}
    for r in requests:
        core.add(r)
    while core.has_work():
        for chunk in core.step():
            out[chunk.request_id].append(chunk)
    return out


def _tokens(chunks) -> list[int]:
    return [t for c in chunks if not isinstance(c, ErrorChunk) for t in c.token_ids]


def _solo(tiny_model_dir, adapters) -> dict:
    core = _engine(tiny_model_dir, adapters)
    return {r.request_id: _tokens(_run(core, [r])[r.request_id]) for r in _requests(SamplingParams())[:2]}


def _assert_idle(core):
    s = core.stats()
    assert s.running == s.waiting == 0 and s.free_kv_blocks == s.total_kv_blocks, s
    assert core.model.lora_pool.pinned() == 0


def test_non_finite_logits_end_only_their_request(tiny_model_dir, adapters):
    core = _engine(tiny_model_dir, adapters)
    run = core.runner.run

    def poisoned(scheduled):  # the "broken" adapter's row turns NaN from its 3rd token on
        logits, sampled = run(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(sampled):
            if seq.request_id == "c" and len(seq.output_ids) >= 2:
                logits[i, ::3] = float("nan")
        return logits, sampled

    core.runner.run = poisoned
    out = _run(core, _requests(SamplingParams(max_tokens=8, temperature=1e-30, top_p=1e-40, seed=1)))
    assert isinstance(out["c"][-1], ErrorChunk) and "non-finite" in out["c"][-1].message
    assert len(_tokens(out["c"])) == 2
    assert {k: _tokens(out[k]) for k in "ab"} == _solo(tiny_model_dir, adapters)
    _assert_idle(core)


def test_an_adapter_failing_to_load_ends_only_its_request(tiny_model_dir, adapters):
    core = _engine(tiny_model_dir, adapters)
    pool, load = core.model.lora_pool, core.model.lora_pool._load

    def load_or_fail(slot, weights):
        if weights.name == "broken":
            raise RuntimeError("copy failed")
        return load(slot, weights)

    pool._load = load_or_fail
    out = _run(core, _requests(SamplingParams(max_tokens=8)))
    assert len(out["c"]) == 1 and isinstance(out["c"][0], ErrorChunk)
    assert "'broken' could not be loaded: copy failed" in out["c"][0].message
    assert {k: _tokens(out[k]) for k in "ab"} == _solo(tiny_model_dir, adapters)
    _assert_idle(core)
    assert len(pool.resident()) == 1  # the failed load left no slot behind: only "x" is resident
    pool._load = load  # the slot is free for the next try
    assert _tokens(_run(core, _requests(SamplingParams(max_tokens=3))[2:])["c"])


def test_tiny_temperature_and_top_p_sample_the_greedy_token(tiny_model_dir, adapters):
    core = _engine(tiny_model_dir, adapters)
    greedy = _tokens(_run(core, [GenerateRequest("g", (1, 2, 3), SamplingParams(max_tokens=6, temperature=0))])["g"])
    for i, params in enumerate(
        [
            dict(temperature=5e-324),
            dict(temperature=1e-38, top_k=10**18),
            dict(top_p=5e-324, temperature=2.0),
            dict(top_p=1e-46),
        ]
    ):
        got = _run(core, [GenerateRequest(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=6, seed=i, **params))])
        assert _tokens(got[f"r{i}"]) == greedy, params
