"""n choices of one request in the engine (docs/n_choices.md): each choice equals its request run
alone with its derived seed, and the prompt's full KV blocks are computed once and held once by all
choices (reference counts), with the prefix cache on or off, an adapter or the base model, a chunked
prefill, a batch too small for all choices, preemption and aborts, leaking no block.

Engines compute in float64: a forked choice recomputes its prompt's last block as a prefill of its
own, another batch shape than the solo run's, and fp32 rounding could move a sampled draw across a
token boundary (see tests/unit/test_stream_coalescing.py)."""

import asyncio
import random

import pytest
import torch

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, Migrate, SamplingParams, TokenChunk, choice_seed, coalesce
from tests.support.helpers import make_random_adapter

BS = 4


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(
        tiny_model_dir, tmp_path_factory.mktemp("nc") / "a1", rank=8, targets=["q_proj", "v_proj", "down_proj"], seed=5
    )


def _engine(model, adapter_dir, **kw):
    cfg = EngineConfig(
        **{
            "max_lora_rank": 8,
            "max_loras": 2,
            "block_size": BS,
            "num_kv_blocks": 128,
            "max_tokens_per_step": 256,
            "dtype": torch.float64,
            **kw,
        }
    )
    return build_engine(model, cfg, {"a1": str(adapter_dir)}, tokenizer=None)


def _request(rng, n, prompt_len, adapter=None, **params):
    params = {"max_tokens": 10, "temperature": 1.0, "top_k": 40, "seed": rng.getrandbits(63), **params}
    prompt = tuple(rng.randrange(320) for _ in range(prompt_len))
    return GenerateRequest(f"req{rng.getrandbits(32)}", prompt, SamplingParams(**params), adapter, n=n)


def _run(engine, request, on_step=None, abort_at=None):
    """Step the engine until the request ends; choice index → (tokens, finish reasons seen)."""
    engine.add(request)
    out = {i: ([], []) for i in range(request.index, request.index + request.n)}
    step = 0
    while engine.has_work():
        chunks = engine.abort(request.request_id) if step == abort_at else engine.step()
        for chunk in chunks:
            if isinstance(chunk, Migrate):  # preempted: that choice alone comes back, with its own seed
                engine.add(request.resumed(chunk))
                continue
            out[chunk.index][0].extend(chunk.token_ids)
            if chunk.finish_reason:
                out[chunk.index][1].append(chunk.finish_reason)
        if on_step:
            on_step(engine)
        step += 1
        assert step < 2000
    engine.allocator.check()
    return out


def _alone(model, adapter_dir, request):
    """Each choice run alone, as its own request with its derived seed, on a fresh engine."""
    outs = {}
    for j in range(request.n):
        solo = request.choice(j)
        assert solo.n == 1 and solo.params.seed == choice_seed(request.params.seed, j)
        outs[j] = _run(_engine(model, adapter_dir), solo)[j][0]
    return outs


@pytest.mark.parametrize("adapter", [None, "a1"])
@pytest.mark.parametrize("cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_choices_equal_their_seeds_alone_and_share_the_prompt_blocks(tiny_model_dir, adapter_dir, adapter, cache):
    rng = random.Random()
    request = _request(rng, 4, rng.randint(14, 30), adapter, min_tokens=10)
    engine = _engine(tiny_model_dir, adapter_dir, prefix_caching=cache)
    prompt_blocks = -(-len(request.prompt_token_ids) // BS)
    shared = (len(request.prompt_token_ids) - 1) // BS  # full blocks before the prompt's last token's
    seen = []

    def check(e):
        running = e.scheduler.running
        if len(running) == 4:
            tables = [s.block_table for s in running]
            assert all(t[:shared] == tables[0][:shared] for t in tables)  # one copy of the prompt's full blocks
            assert all(e.allocator._refs[b] == 4 for b in tables[0][:shared])
            assert len({b for t in tables for b in t[shared:]}) == sum(len(t) - shared for t in tables)  # tails private
            in_use = e.allocator.num_blocks - e.allocator.num_free
            seen.append(in_use)
            assert in_use < 4 * prompt_blocks

    out = _run(engine, request, on_step=check)
    assert seen, "the four choices never ran together"
    assert {i: toks for i, (toks, _) in out.items()} == _alone(tiny_model_dir, adapter_dir, request)
    assert all(reasons == ["length"] for _, reasons in out.values())  # each choice ends exactly once
    tail = len(request.prompt_token_ids) - shared * BS
    assert engine.tokens_computed == len(request.prompt_token_ids) + 3 * tail + 4 * 9  # the prompt's blocks once
    assert engine.allocator.num_free == engine.allocator.num_blocks
    if cache:
        assert engine.prefix.hit_tokens[adapter or ""] == 0  # forks are not cache hits


def test_chunked_prefill_a_small_batch_and_a_first_choice_that_ends_at_once(tiny_model_dir, adapter_dir):
    """The prompt takes several steps, only two choices fit in the batch at once (the others wait
    holding their forked blocks), and with max_tokens=1 the first choice ends in the very step the
    others fork: they still share its blocks and equal their solo runs."""
    rng = random.Random()
    for max_tokens in (1, 7):
        request = _request(rng, 5, rng.randint(20, 33), "a1", max_tokens=max_tokens, min_tokens=max_tokens)
        engine = _engine(tiny_model_dir, adapter_dir, max_tokens_per_step=8, max_num_seqs=2, prefix_caching=False)
        out = _run(engine, request)
        assert {i: toks for i, (toks, _) in out.items()} == _alone(tiny_model_dir, adapter_dir, request)
        shared = (len(request.prompt_token_ids) - 1) // BS
        tail = len(request.prompt_token_ids) - shared * BS
        assert engine.tokens_computed == len(request.prompt_token_ids) + 4 * tail + 5 * (max_tokens - 1)
        assert engine.allocator.num_free == engine.allocator.num_blocks


def test_preemption_moves_single_choices_and_aborts_leak_nothing(tiny_model_dir, adapter_dir):
    rng = random.Random()
    request = _request(rng, 4, 18, None, max_tokens=24, min_tokens=24)
    engine = _engine(tiny_model_dir, adapter_dir, num_kv_blocks=20, prefix_caching=False)
    moved = []
    engine_add = engine.add
    engine.add = lambda r: (moved.append(r) if r.resume_token_ids else None, engine_add(r))
    out = _run(engine, request)
    assert moved and all(r.n == 1 and r.params.seed == choice_seed(request.params.seed, r.index) for r in moved)
    assert {i: toks for i, (toks, _) in out.items()} == _alone(tiny_model_dir, adapter_dir, request)
    assert all(reasons == ["length"] for _, reasons in out.values())
    assert engine.allocator.num_free == 20

    for abort_at in (0, 1, 3):  # before the fork, right after it, while all decode
        engine = _engine(tiny_model_dir, adapter_dir, prefix_caching=bool(abort_at % 2))
        out = _run(engine, _request(rng, 3, 17), abort_at=abort_at)
        assert all(reasons == ["abort"] for _, reasons in out.values())
        assert engine.allocator.num_free == engine.allocator.num_blocks and not engine.has_work()


def test_short_prompts_and_greedy_choices(tiny_model_dir, adapter_dir):
    """A prompt within one block shares nothing (each choice computes it); greedy choices are equal."""
    rng = random.Random()
    engine = _engine(tiny_model_dir, adapter_dir)
    short = _request(rng, 3, 3)
    out = _run(engine, short)
    assert engine.tokens_computed == 3 * 3 + 3 * 9
    assert {i: toks for i, (toks, _) in out.items()} == _alone(tiny_model_dir, adapter_dir, short)
    greedy = _run(_engine(tiny_model_dir, adapter_dir), _request(rng, 3, 13, temperature=0.0))
    assert greedy[0][0] == greedy[1][0] == greedy[2][0]


def test_async_engine_streams_every_choice_once(tiny_model_dir, adapter_dir):
    """Through the async engine (local migration on a small cache): one stream, each choice ending once."""
    rng = random.Random()
    request = _request(rng, 3, 15, "a1", max_tokens=20, min_tokens=20)
    engine = AsyncEngine(_engine(tiny_model_dir, adapter_dir, num_kv_blocks=16, requeue_preempted=True))

    async def go():
        return [item async for item in engine.generate(request)]

    try:
        items = asyncio.run(go())
    finally:
        engine.shutdown()
    tokens = {i: [t for c in items if c.index == i for t in c.token_ids] for i in range(3)}
    assert sorted(c.index for c in items if c.finish_reason) == [0, 1, 2]  # each choice ends once
    assert tokens == _alone(tiny_model_dir, adapter_dir, request)
    assert engine.core.allocator.num_free == 16
    # preempted choices were requeued by the scheduler: none left its stream as a Migrate
    assert engine.core.preemptions > 0 and not any(isinstance(c, Migrate) for c in items)


def test_choice_seeds_and_per_choice_coalescing():
    assert choice_seed(5, 3) == 8 and choice_seed(2**63 - 1, 1) == -(2**63)  # still a seed the API accepts
    r = GenerateRequest("r", (1, 2), SamplingParams(seed=2**63 - 2), n=3)
    assert [c.params.seed for c in map(r.choice, range(3))] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert r.resumed(Migrate("r", (1, 2), (9,), 77, "kv_cache_exhausted", 2)) == GenerateRequest(
        "r", (1, 2), SamplingParams(seed=77), resume_token_ids=(9,), n=1, index=2
    )
    chunks = [
        TokenChunk("r", (1,), "a", index=0),
        TokenChunk("r", (2,), "b", index=1),
        TokenChunk("r", (3,), "c", index=0),
        Migrate("r", (), (2,), 1, "kv_cache_exhausted", 1),
        TokenChunk("r", (4,), "d", finish_reason="stop", index=0),
        TokenChunk("r", (5,), "e", index=2),
    ]
    merged = coalesce(chunks)
    assert [(c.index, getattr(c, "token_ids", None)) for c in merged] == [
        (0, (1, 3, 4)),
        (1, (2,)),
        (1, None),
        (2, (5,)),
    ]
    assert merged[0].finish_reason == "stop"
