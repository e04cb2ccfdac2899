"""n choices in the ingress, without Ray Serve: one replica call carries every choice, each choice
moves alone (its own request: index, seed, relayed tokens) and ends exactly once; the OpenAI shapes
(choices with their index, interleaved stream chunks, usage counting every choice and the prompt
once, best_of ranking by cumulative logprob) and the request validation of n and best_of."""

import asyncio
import json
import random
from contextlib import aclosing

import pytest
from fastapi.exceptions import RequestValidationError
from ray.exceptions import ActorDiedError

from app.errors import InvalidRequestError
from app.openai.choice_streams import Choices
from app.openai.client_stream import MigrationPolicy, collect, sse_events, with_fixed_seed
from app.openai.http_errors import parse_json
from app.openai.live_streams import LiveStreams
from app.openai.requests import ChatCompletionRequest, CompletionRequest
from app.openai.responses import Formatter
from app.protocol import Accepted, GenerateRequest, Migrate, SamplingParams, TokenChunk, choice_seed

POLICY = MigrationPolicy(max_migrations=3, failover_wait_s=0.2)


HANG = object()  # a replica that answers no more


class _Script:
    """A replica's stream: its items, then the end (or an exception it raises)."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), 0

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item is HANG:
            await asyncio.sleep(3600)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled += 1


def _tok(i, t, finish=None, logprob=None):
    lp = ({"token_id": t, "logprob": logprob, "top": ()},) if logprob is not None else None
    return TokenChunk("r", (t,), f"<{t}>", lp, finish, 3, 0, i)


def _run(scripts, n=3, leave_after=None):
    """(chunks relayed, requests submitted, the scripts) for a request of n choices."""
    submitted, given = [], list(scripts)

    def submit(request):
        submitted.append(request)
        return scripts.pop(0)

    async def go():
        request = with_fixed_seed(GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=9), n=n))
        choices = await Choices.open(submit, request, POLICY, LiveStreams())
        out = []
        async with aclosing(choices.chunks()) as relayed:  # as the ingress relays it
            async for c in relayed:
                out.append(c)
                if len(out) == leave_after:
                    break
        return out

    return asyncio.run(go()), submitted, given


def _by_choice(chunks):
    return {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in sorted({c.index for c in chunks})}


def test_a_migrating_choice_moves_alone_with_its_seed_and_tokens():
    chunks, submitted, scripts = _run(
        [
            _Script(
                [
                    Accepted("A"),
                    _tok(0, 10),
                    _tok(1, 20),
                    _tok(2, 30),
                    _tok(1, 21),
                    Migrate("r", (1, 2, 3), (20, 21), 0, "kv_cache_exhausted", 1),
                    _tok(0, 11, "stop"),
                    _tok(2, 31, "length"),
                ]
            ),
            _Script([Accepted("B"), _tok(1, 22), _tok(1, 23, "length")]),
        ]
    )
    assert _by_choice(chunks) == {0: [10, 11], 1: [20, 21, 22, 23], 2: [30, 31]}
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]  # each choice ends once
    group, moved = submitted
    assert group.n == 3 and moved.n == 1 and moved.index == 1 and moved.request_id == "r-1"
    assert moved.params.seed == choice_seed(group.params.seed, 1) and moved.resume_token_ids == (20, 21)
    assert moved.migrated_from == "A" and scripts[0].cancelled == 0  # the others carried on there


def test_a_failed_replica_moves_every_unfinished_choice_alone():
    chunks, submitted, _ = _run(
        [
            _Script([Accepted("A"), _tok(0, 10), _tok(2, 30, "stop"), _tok(1, 20), ActorDiedError()]),
            _Script([Accepted("B"), _tok(0, 11, "length")]),
            _Script([Accepted("C"), _tok(1, 21, "length")]),
        ]
    )
    assert _by_choice(chunks) == {0: [10, 11], 1: [20, 21], 2: [30]}
    moved = sorted(submitted[1:], key=lambda r: r.index)
    assert [(r.index, r.resume_token_ids, r.avoid_replicas) for r in moved] == [(0, (10,), ("A",)), (1, (20,), ("A",))]


def test_a_rejected_request_raises_before_any_response_and_leaving_early_aborts_once():
    with pytest.raises(InvalidRequestError):
        _run([_Script([Accepted("A"), InvalidRequestError("the prompt is empty")])])
    chunks, _, scripts = _run([_Script([Accepted("A")] + [_tok(i % 3, i) for i in range(30)] + [HANG])], leave_after=4)
    assert len(chunks) == 4 and scripts[0].cancelled == 1


def _stream_events(fmt, chunks, include_usage=True):
    class _Stream:
        async def chunks(self):
            for c in chunks:
                yield c

    async def go():
        return [e async for e in sse_events(fmt, _Stream(), include_usage)]

    text = b"".join(asyncio.run(go())).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


class _Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


def test_stream_and_response_shapes():
    fmt = Formatter("chatcmpl-1", "m", _Tok(), chat=True, want_logprobs=False, n=2)
    chunks = [
        _tok(1, 5),
        _tok(0, 6),
        TokenChunk("r", (7,), "<7>", None, "stop", 3, 2, 1),
        TokenChunk("r", (8,), "<8>", None, "length", 3, 4, 0),
    ]
    events = _stream_events(fmt, chunks)
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # the role opens each choice
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2])
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]["content"]) for e in events[2:6]] == [
        (1, "<5>"),
        (0, "<6>"),
        (1, "<7>"),
        (0, "<8>"),
    ]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
    }
    assert len(events) == 7  # one usage chunk, after the last choice ended


def test_best_of_returns_the_highest_cumulative_logprobs_and_counts_every_token():
    rng = random.Random()
    logprobs = [[-rng.random() * 3 for _ in range(rng.randint(1, 4))] for _ in range(5)]
    chunks = [
        TokenChunk(
            "r",
            (i,),
            f"<{i}>",
            tuple({"token_id": i, "logprob": lp, "top": ()} for lp in lps),
            "length",
            3,
            len(lps),
            i,
        )
        for i, lps in enumerate(logprobs)
    ]

    class _Stream:
        async def chunks(self):
            for c in chunks:
                yield c

    fmt = Formatter("cmpl-1", "m", _Tok(), chat=False, want_logprobs=False, n=2)
    body = json.loads(asyncio.run(collect(fmt, _Stream(), 5)).body)
    ranked = sorted(range(5), key=lambda i: -sum(logprobs[i]))[:2]
    assert [c["text"] for c in body["choices"]] == [f"<{i}>" for i in ranked]
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == sum(map(len, logprobs)) and body["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n": 0}, "greater than or equal to 1"),
        ({"n": 17}, "less than or equal to 16"),
        ({"n": 3, "best_of": 2}, "best_of (2) must be >= n (3)"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of > n cannot be streamed"),
    ],
)
def test_n_and_best_of_are_validated(fields, message):
    raw = json.dumps({"model": "m", "prompt": "hi", **fields}).encode()
    with pytest.raises(RequestValidationError) as err:
        parse_json(raw, CompletionRequest)
    assert message in err.value.errors()[0]["msg"]
    ok = parse_json(json.dumps({"model": "m", "prompt": "hi", "n": 2, "best_of": 4}).encode(), CompletionRequest)
    assert (ok.n, ok.generated) == (2, 4)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}
    assert parse_json(json.dumps({**chat, "stream": True}).encode(), ChatCompletionRequest).generated == 3
    # best_of on chat: vLLM's extension
    assert parse_json(json.dumps({**chat, "best_of": 5}).encode(), ChatCompletionRequest).generated == 5
    with pytest.raises(RequestValidationError):
        parse_json(json.dumps({**chat, **fields}).encode(), ChatCompletionRequest)  # the same rules


class _Call:
    """LoraReplica.generate over an AsyncEngine, as Serve's streaming handle gives it to the ingress."""

    def __init__(self, engine, request):
        self.items, self.pending = self._items(engine, request), None

    @staticmethod
    async def _items(engine, request):
        yield Accepted("A")
        async for chunk in engine.generate(request):
            yield chunk

    async def __anext__(self):
        self.pending = asyncio.ensure_future(self.items.__anext__())
        return await self.pending

    def cancel(self):  # Serve cancels the call: the engine's generator closes, aborting what still runs
        if self.pending is not None:
            self.pending.cancel()


def test_choices_moved_by_the_ingress_equal_their_seeds_alone(tiny_model_dir):
    """A real engine whose small KV cache preempts choices, each moved by the ingress (not locally):
    every choice ends once, equal to its request alone, and no KV block stays held."""
    import torch

    from app.engine.async_engine import AsyncEngine
    from app.engine.config import EngineConfig
    from app.engine.factory import build_engine

    def engine(blocks):
        cfg = EngineConfig(block_size=4, num_kv_blocks=blocks, dtype=torch.float64, prefix_caching=False)
        return build_engine(tiny_model_dir, cfg, {}, tokenizer=None)

    rng = random.Random()
    request = with_fixed_seed(
        GenerateRequest(
            "r",
            tuple(rng.randrange(320) for _ in range(17)),
            SamplingParams(max_tokens=20, min_tokens=20, temperature=0.9),
            n=3,
        )
    )
    small = AsyncEngine(engine(17))
    submitted = []

    def submit(r):
        submitted.append(r)
        return _Call(small, r)

    async def go():
        choices = await Choices.open(submit, request, POLICY, LiveStreams())
        async with aclosing(choices.chunks()) as relayed:
            return [c async for c in relayed]

    try:
        chunks = asyncio.run(go())
    finally:
        small.shutdown()
    assert len(submitted) > 1 and all(r.n == 1 for r in submitted[1:])  # choices moved, one by one
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    alone = engine(128)
    for j in range(3):
        alone.add(request.choice(j))
    expected = {j: [] for j in range(3)}
    while alone.has_work():
        for c in alone.step():
            expected[c.index] += c.token_ids
    assert _by_choice(chunks) == expected
    assert small.core.allocator.num_free == 17
