"""Prefix caching on the tiny model: outputs with the cache equal outputs without it (greedy
and seeded sampling), no sharing across adapters, the base model or adapter versions, a prompt
ending on a block boundary, preempted requests that come back, and cached blocks evicted before
any request is preempted."""

import random

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import hf_greedy, make_random_adapter, run_to_completion

BS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=77)
PARAMS = pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-sampling"])


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pc-adapters")
    return {
        name: make_random_adapter(
            tiny_model_dir, root / name, rank=8, targets=["q_proj", "k_proj", "v_proj", "down_proj"], seed=i + 10
        )
        for i, name in enumerate(("a1", "a2", "a1-v2"))
    }


def _engine(model, adapters, cache=True, **kw):
    cfg = EngineConfig(
        **{
            "max_lora_rank": 8,
            "max_loras": 3,
            "block_size": BS,
            "num_kv_blocks": 128,
            "max_tokens_per_step": 64,
            "prefix_caching": cache,
            **kw,
        }
    )
    return build_engine(model, cfg, {n: str(adapters[n]) for n in ("a1", "a2")}, tokenizer=None)


def _tokens(rng, n):
    return [rng.randrange(320) for _ in range(n)]


def _hits(engine, adapter=""):
    return engine.prefix.hit_tokens[adapter]


@PARAMS
def test_shared_system_prompt_of_one_adapter(tiny_model_dir, adapters, params):
    rng = random.Random(0)
    system = _tokens(rng, 22)
    jobs = {
        k: [GenerateRequest(f"q{k}", tuple(system + _tokens(rng, rng.randint(1, 9))), params, "a1")]
        for k in (0, 2, 3, 9, 10)
    }
    off = _engine(tiny_model_dir, adapters, cache=False)
    on = _engine(tiny_model_dir, adapters)
    expected, _, _ = run_to_completion(off, jobs)
    got, _, _ = run_to_completion(on, jobs)
    assert got == expected
    assert _hits(on, "a1") == 4 * 20, "each request after the first reads the 5 full system-prompt blocks"
    assert on.tokens_computed == off.tokens_computed - 4 * 20
    if params.greedy:  # and the cached path is the model's: equal HF + PEFT
        assert got["q10"] == hf_greedy(tiny_model_dir, adapters["a1"], list(jobs[10][0].prompt_token_ids), 12)
    on.allocator.check()
    assert on.allocator.num_free == on.allocator.num_blocks


@PARAMS
def test_no_sharing_across_adapters_or_the_base_model(tiny_model_dir, adapters, params):
    prompt = tuple(_tokens(random.Random(1), 25))
    order = ["a1", "a2", None, "a1"]
    jobs = {4 * i: [GenerateRequest(f"q{i}", prompt, params, a)] for i, a in enumerate(order)}
    on = _engine(tiny_model_dir, adapters)
    got, _, _ = run_to_completion(on, jobs)
    expected, _, _ = run_to_completion(_engine(tiny_model_dir, adapters, cache=False), jobs)
    assert got == expected
    assert _hits(on, "a2") == 0 and _hits(on, "") == 0, "KV was shared across weights"
    assert _hits(on, "a1") == 24, "the second a1 request reads its 6 full blocks"
    assert len({tuple(got[f"q{i}"]) for i in range(3)}) == 3, "the three weights should give three outputs"


@PARAMS
def test_adapter_re_registered_with_new_weights_shares_nothing_with_the_old(tiny_model_dir, adapters, params):
    prompt = tuple(_tokens(random.Random(2), 30))
    engine = _engine(tiny_model_dir, adapters)
    old, _, _ = run_to_completion(engine, {0: [GenerateRequest("old", prompt, params, "a1")]})
    cached = engine.allocator.num_cached
    assert cached == (30 + 12 - 1) // BS  # prompt and generated tokens alike
    engine.adapters.register("a1", str(adapters["a1-v2"]))
    new, _, _ = run_to_completion(engine, {0: [GenerateRequest("new", prompt, params, "a1")]})
    assert _hits(engine, "a1") == 0, "the new version read the old version's KV"
    fresh = build_engine(tiny_model_dir, engine.config, {"a1": str(adapters["a1-v2"])}, tokenizer=None)
    alone, _, _ = run_to_completion(fresh, {0: [GenerateRequest("new", prompt, params, "a1")]})
    assert new == alone and new["new"] != old["old"]
    assert engine.allocator.num_cached == 2 * cached  # both versions' blocks, side by side


def test_prompt_ending_on_a_block_boundary_computes_its_last_block(tiny_model_dir, adapters):
    prompt = tuple(_tokens(random.Random(3), 4 * BS))
    jobs = {
        0: [GenerateRequest("a", prompt, GREEDY, "a2")],
        3: [GenerateRequest("b", prompt, GREEDY, "a2")],
        4: [GenerateRequest("c", prompt, SEEDED, None)],
        6: [GenerateRequest("d", prompt, SEEDED, None)],
    }
    on = _engine(tiny_model_dir, adapters)
    got, _, _ = run_to_completion(on, jobs)
    expected, _, _ = run_to_completion(_engine(tiny_model_dir, adapters, cache=False), jobs)
    assert got == expected and got["a"] == got["b"]
    assert _hits(on, "a2") == _hits(on, "") == 3 * BS, "all but the last block come from the cache"


@PARAMS
def test_preempted_requests_come_back_to_their_cached_blocks(tiny_model_dir, adapters, params):
    rng = random.Random(4)
    system = _tokens(rng, 12)
    long = SamplingParams(**{**vars(params), "max_tokens": 40})
    reqs = [
        GenerateRequest(f"r{i}", tuple(system + _tokens(rng, rng.randint(2, 8))), long, ("a1", None)[i % 2])
        for i in range(6)
    ]
    expected, _, migrates = run_to_completion(_engine(tiny_model_dir, adapters, cache=False), {0: reqs})
    assert not migrates
    tight = _engine(tiny_model_dir, adapters, num_kv_blocks=40)
    by_id = {r.request_id: r for r in reqs}
    resumed_hits, admitted = [], tight.prefix.admitted

    def count(seq, hits):  # hits of each resumed request at its admission
        if seq.request.resume_token_ids:
            resumed_hits.append(hits)
        admitted(seq, hits)

    tight.prefix.admitted = count
    got, _, migrates = run_to_completion(
        tight, {0: reqs}, on_migrate=lambda m: tight.add(by_id[m.request_id].resumed(m))
    )
    assert migrates and any(m.output_token_ids for m in migrates), "no request was preempted mid-generation"
    assert got == expected
    assert any(resumed_hits), "no preempted request found its blocks again"
    tight.allocator.check()
    assert tight.allocator.num_free == 40


def test_cached_blocks_are_evicted_before_any_request_is_preempted(tiny_model_dir, adapters):
    engine = _engine(tiny_model_dir, adapters, num_kv_blocks=40, max_num_seqs=8)
    rng = random.Random(5)
    warm = {0: [GenerateRequest(f"w{i}", tuple(_tokens(rng, 20)), GREEDY, None) for i in range(6)]}
    run_to_completion(engine, warm)
    assert engine.allocator.num_cached >= 30, "the finished requests' blocks should stay cached"
    # 4 requests of 24 prompt + 16 new tokens need all 40 blocks at their peak
    load = {
        0: [
            GenerateRequest(f"n{i}", tuple(_tokens(rng, 24)), SamplingParams(max_tokens=16, temperature=0.0), "a1")
            for i in range(4)
        ]
    }
    got, reasons, migrates = run_to_completion(engine, load)
    assert not migrates, "a request was preempted while cached blocks could have been evicted"
    assert set(reasons.values()) == {"length"}
    engine.allocator.check()
    assert engine.allocator.num_free == 40


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_finishes_and_aborts_leak_no_block(tiny_model_dir, adapters, seed):
    """Random arrivals (over 3 shared prefixes and 3 weights), aborts and preemptions on a small
    cache: every step each block is free, cached or held exactly as the requests' tables say, and
    every request that was not aborted ends with the output of an uncached roomy engine."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(4, 14)) for _ in range(3)]
    reqs = [
        GenerateRequest(
            f"r{i}",
            tuple(rng.choice(systems) + _tokens(rng, rng.randint(1, 6))),
            SamplingParams(max_tokens=rng.randint(1, 14), temperature=rng.choice([0.0, 0.8]), seed=i),
            rng.choice(["a1", "a2", None]),
        )
        for i in range(12)
    ]
    arrive = {i: rng.randint(0, 12) for i in range(len(reqs))}
    aborts = {rng.randint(0, 30): f"r{rng.randrange(len(reqs))}" for _ in range(3)}
    engine = _engine(
        tiny_model_dir,
        adapters,
        num_kv_blocks=14,
        max_num_seqs=5,
        max_tokens_per_step=24,
        prefix_cache_max_blocks=[None, 4, 0][seed],
    )
    by_id, outputs, aborted, step, preempted = {r.request_id: r for r in reqs}, {}, set(), 0, 0
    while engine.has_work() or step <= 30:
        for i, k in arrive.items():
            if k == step:
                engine.add(reqs[i])
        if step in aborts and engine.abort(aborts[step]):
            aborted.add(aborts[step])
        for c in engine.step():
            if hasattr(c, "seed"):
                engine.add(by_id[c.request_id].resumed(c))
                preempted += 1
            else:
                outputs.setdefault(c.request_id, []).extend(c.token_ids)
        _check_blocks(engine)
        step += 1
        assert step < 2000
    assert preempted, "the small cache should have forced a preemption"
    assert engine.allocator.num_free == 14
    if seed == 2:
        assert engine.allocator.num_cached == 0
    done = {rid: r for rid, r in by_id.items() if rid not in aborted}
    expected, _, _ = run_to_completion(
        _engine(tiny_model_dir, adapters, cache=False, num_kv_blocks=256), {0: list(done.values())}
    )
    assert {rid: outputs[rid] for rid in done} == expected


def _check_blocks(engine):
    a = engine.allocator
    a.check()
    held = [0] * a.num_blocks
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            held[b] += 1
    assert held == a._refs, "a block's references differ from the tables that hold it"
    assert not any(s.block_table for s in engine.scheduler.waiting)


def test_allocator_takes_empty_blocks_then_evicts_a_prefix_tail_first():
    from app.engine.kv_cache import BlockAllocator

    a = BlockAllocator(6)
    table = a.allocate(4)
    a.cache(table[0], b"head")
    a.cache(table[1], b"tail")
    a.free(table)
    assert (a.num_free, a.num_cached) == (6, 2)
    a.allocate(5)  # the 4 empty blocks, then one cached: the table's tail before its head
    assert a.lookup([b"tail"]) == [] and a.lookup([b"head", b"tail"]) == [table[0]]
    assert a.num_free == 0
    a.check()
