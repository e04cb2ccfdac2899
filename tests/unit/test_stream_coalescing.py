"""Coalesced streams (app/engine/async_engine.py, app/openai/client_stream.py) on the tiny chat
model, without Serve: a reader that falls behind gets several tokens per item and their
concatenation is the unbatched output; a reader that keeps up gets the first token alone
at once; a stream that moves in the middle of a coalesced item resumes exactly."""

import asyncio
import random
import threading
import time

import pytest
import torch

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.openai.client_stream import MigrationPolicy, ResubmittingStream, with_fixed_seed
from app.openai.live_streams import LiveStreams
from app.protocol import Accepted, GenerateRequest, SamplingParams, TokenChunk, coalesce, is_final
from benchmarks.simulated_engine import SimulatedCore, StepTime
from tests.support.cluster_fixtures import make_tiny_chat_llama

# float64: a resumed request is recomputed in another shape; fp32 rounding can move a sampled draw of
# the tiny model's near-uniform distribution across a token boundary (3 resumed streams in 100).
CONFIG = EngineConfig(max_num_seqs=8, num_kv_blocks=256, block_size=4, max_model_len=256, dtype=torch.float64)
WAIT_S = 60  # a bound that only a broken engine reaches


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("chat") / "model")


def _requests(n, seed=3):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        params = SamplingParams(
            max_tokens=rng.randint(12, 24),
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            logprobs=2 if i % 3 == 0 else None,
            stop=(" the", "ing") if i % 4 == 1 else (),
        )
        out.append(GenerateRequest(f"r{i}", tuple(rng.randrange(100, 49000) for _ in range(5)), params))
    return out


@pytest.fixture(scope="module")
def alone(model):
    core = build_engine(model, CONFIG, {})
    return lambda request: _alone(core, request)


def _alone(core, request) -> list[TokenChunk]:
    """The request run alone, one step at a time: the unbatched, uncoalesced output."""
    core.add(request)
    out = []
    while core.has_work():
        out += [c for c in core.step() if isinstance(c, TokenChunk)]
    return out


def _gated(core, tokens: int) -> threading.Event:
    """Hold ``core`` (its steps do nothing) once a request has ``tokens`` output tokens, until the
    Event is set; the engine thread keeps serving its inbox (drain, abort) meanwhile."""
    gate, step = threading.Event(), core.step

    def gated_step():
        if not gate.is_set() and any(len(s.output_ids) >= tokens for s in core.scheduler.running):
            time.sleep(0.001)
            return []
        return step()

    core.step = gated_step
    return gate


def _summary(chunks):
    last = chunks[-1]
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        [lp for c in chunks for lp in (c.logprobs or ())],
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
    )


def _close(got, want):
    """Equal token for token; logprobs up to fp32 noise (a batch sums in another order)."""
    assert got[:2] == want[:2] and got[3:] == want[3:]
    assert [e["token_id"] for e in got[2]] == [e["token_id"] for e in want[2]]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(got[2], want[2]))


async def _until(predicate, engine):
    """Wait until predicate(core) holds on the engine thread; hand-overs queued before it have run."""
    for _ in range(WAIT_S * 100):
        if await asyncio.wrap_future(engine.call(predicate)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never got there")


def test_coalesce_merges_runs_and_keeps_the_final_item_last():
    a, b = (
        TokenChunk("r", (1,), "a", ({"token_id": 1},), None, 3, 1),
        TokenChunk("r", (2, 3), "bc", ({"token_id": 2}, {"token_id": 3}), "stop", 3, 3),
    )
    (merged,) = coalesce([a, b])
    assert merged == TokenChunk(
        "r", (1, 2, 3), "abc", ({"token_id": 1}, {"token_id": 2}, {"token_id": 3}), "stop", 3, 3
    )
    assert is_final(merged) and not is_final(a)


def test_a_reader_behind_gets_several_tokens_per_item_equal_to_the_unbatched_output(model, alone):
    requests = _requests(6)
    assert all(r.params.max_tokens >= 12 for r in requests)
    engine = AsyncEngine(build_engine(model, CONFIG, {}))

    async def go():
        streams = [engine.generate(r) for r in requests]
        firsts = [await s.__anext__() for s in streams]  # every request runs
        await _until(lambda core: not core.has_work(), engine)  # ... to its end, none of it read
        return [[first] + [item async for item in s] for first, s in zip(firsts, streams)]

    try:
        got = asyncio.run(go())
    finally:
        engine.shutdown()
    behind = [items for items in got if not is_final(items[0])]  # (a stop string may end one at once)
    assert len(behind) >= 4
    assert all(len(items) == 2 and len(items[1].token_ids) >= 2 for items in behind)  # the rest in one item
    for request, items in zip(requests, got):
        _close(_summary(items), _summary(alone(request)))


class _OneThenWait(SimulatedCore):
    """Emits a request's first token, then blocks its next step until the test releases it."""

    def __init__(self):
        super().__init__(CONFIG, StepTime(0.0))
        self.release = threading.Event()

    def step(self):
        if self.steps >= 1 and not self.release.wait(WAIT_S):
            raise AssertionError("the first item never reached the reader")
        return super().step()


def test_one_reader_gets_the_first_token_without_waiting_for_a_second():
    core = _OneThenWait()
    engine = AsyncEngine(core)
    request = GenerateRequest("solo", (5, 6, 7), SamplingParams(max_tokens=8, temperature=0.0))

    async def go():
        stream = engine.generate(request)
        first = await asyncio.wait_for(stream.__anext__(), WAIT_S)
        core.release.set()  # only now can a second token be computed
        return first, [item async for item in stream]

    try:
        first, rest = asyncio.run(go())
    finally:
        core.release.set()
        engine.shutdown()
    assert first.token_ids and len(first.token_ids) == 1
    assert len([t for c in [first, *rest] for t in c.token_ids]) == 8 and rest[-1].finish_reason == "length"


class _Call:
    """A replica call as the ingress sees it (Accepted, then the engine's items); cancel() aborts."""

    def __init__(self, replica_id, engine, request):
        self.gen = self._items(replica_id, engine, request)

    @staticmethod
    async def _items(replica_id, engine, request):
        yield Accepted(replica_id)
        async for item in engine.generate(request):
            yield item

    def __anext__(self):
        return self.gen.__anext__()

    def cancel(self):
        asyncio.ensure_future(self.gen.aclose())


@pytest.mark.parametrize("how", ["drain", "replica_stopped"])
def test_a_move_in_the_middle_of_a_coalesced_item_resumes_exactly(model, alone, how):
    """The source has computed several tokens the reader has not taken (one coalesced item)
    when it drains (the item, then Migrate) or leaves (the item is dropped: the resubmission
    carries only the tokens relayed)."""
    request = with_fixed_seed(
        GenerateRequest("m", (311, 4242, 977, 12), SamplingParams(max_tokens=20, temperature=0.8, logprobs=1))
    )
    source = build_engine(model, CONFIG, {})
    gate = _gated(source, 8)
    engines = {
        "A": AsyncEngine(source),
        "B": AsyncEngine(build_engine(model, CONFIG, {})),
    }
    order = iter("AB")
    submitted = []

    def submit(r):
        submitted.append(r)
        rid = next(order)
        return _Call(rid, engines[rid], r)

    async def go():
        live = LiveStreams()
        stream = await ResubmittingStream.open(
            submit, request, MigrationPolicy(max_migrations=2, failover_wait_s=5), live
        )
        items = stream.chunks()
        got = [await items.__anext__()]
        # A holds 7 tokens past the first, unread, in the stream's pending items
        await _until(lambda core: any(len(s.output_ids) >= 8 for s in core.scheduler.running), engines["A"])
        if how == "drain":
            await asyncio.wrap_future(engines["A"].drain())
        else:
            live.replicas_leaving({"A"})
        got += [item async for item in items]
        return stream, got

    try:
        stream, got = asyncio.run(go())
    finally:
        gate.set()
        for engine in engines.values():
            engine.shutdown()
    assert [reason for reason, _ in stream.moves] == ["draining" if how == "drain" else "replica_stopped"]
    relayed = len(submitted[1].resume_token_ids)
    if how == "drain":
        assert relayed == 8 and max(len(c.token_ids) for c in got[:2]) >= 4  # a coalesced item was relayed
    else:
        assert relayed == len(got[0].token_ids)  # only what the client had
    _close(_summary(got), _summary(alone(request)))


def test_replica_code_runs_on_serves_loop_unless_the_config_says_otherwise():
    """Serve then takes a stream's next item only after sending the previous one (coalescing)."""
    from app.serving.config import parse_args

    def env(replica):
        return parse_args({"replica": replica}, "m").replica_options["ray_actor_options"]["runtime_env"]["env_vars"]

    assert env({"num_replicas": 1})["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    given = env(
        {
            "ray_actor_options": {
                "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1", "X": "y"}}
            }
        }
    )
    assert given == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1", "X": "y"}
