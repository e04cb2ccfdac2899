"""A float64 engine resumes a sampled request token for token: the premise of every migration
test that compares a moved stream with the uninterrupted one (tests/support/cluster_checks.py).

The CPU's attention (ops/paged_reference.py) once ran in fp32 even for a float64 model. A resumed
request's context is recomputed by one prefill where the uninterrupted run built it by decode
steps, and fp32 attention rounds those two differently; the tiny model's near-uniform 49k-token
distribution then put a later sampled draw (top_p 0.9) on the other side of a token boundary. That
was the scale-down test's CI failure (test_cluster_serve.py, d7 moved after 12 tokens, its 81st
token 8550 instead of 8557), reproduced here without Ray or timing: the resume point is given.
The client's side of that move (app/openai/client_stream.py) is held here too: however a stop
interleaves with an item in flight, the resubmission carries exactly the tokens relayed."""

import asyncio
import dataclasses
import random

import pytest
import torch

from app.openai.client_stream import MigrationPolicy, ResubmittingStream, with_fixed_seed
from app.openai.live_streams import LiveStreams
from app.protocol import Accepted, GenerateRequest, SamplingParams, TokenChunk
from ops import paged_reference as ref
from tests.support.cluster_checks import ADAPTERS, Reference, assert_same, make_requests
from tests.support.cluster_fixtures import make_tiny_chat_llama
from tests.support.helpers import make_random_adapter
from tests.unit.test_paged_reference import _case, _one_query


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_float64_attention_is_computed_in_float64(softcap):
    """Prefill rows over cached context and decode rows, float64 in and out: float64 accuracy,
    not fp32's (which is ~1e-7 off, and rounds a prefill and a decode of one position apart)."""
    heads, kv_heads, d = 4, 2, 16
    q, k, v, batch, rows = _case([(0, 9), (6, 3)], [5, 17], heads, kv_heads, d, torch.float64, seed=7)
    out = torch.full_like(q, float("nan"))
    ref.forward(out, q, k, v, batch, d**-0.5, None, softcap)
    kf, vf = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    for t, (table, context, pos) in enumerate(rows):
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(context)])
        want = _one_query(q[t], kf[slots], vf[slots], pos, d**-0.5, None, softcap)
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The scale-down test's model, adapters and reference engine (tests/serve/test_cluster_serve.py)."""
    root = tmp_path_factory.mktemp("precision")
    model = make_tiny_chat_llama(root / "model")
    for i, name in enumerate(ADAPTERS):
        make_random_adapter(
            model, root / "adapters" / name, rank=4 * (i + 1), targets=["q_proj", "v_proj", "down_proj"], seed=i
        )
    return Reference(model, root / "adapters", block_size=16)


def test_the_scale_down_failure_resumes_exactly(reference):
    """d7 of the scale-down test (sampled, adapter a2) resumed after 12 tokens, as in the CI run
    that failed, equals its uninterrupted output. With fp32 attention resuming it after 8 to 12
    or 33 to 40 tokens changed its 81st token."""
    d7 = make_requests(10, random.Random(5), prompt_len=(3, 6), max_tokens=(100, 120), prefix="d")[7]
    assert d7.params.temperature == 0.9 and d7.adapter == "a2"
    want = reference(d7)  # one token per chunk: the first 12 chunks are what the client had
    relayed = want[:12]
    resumed = dataclasses.replace(
        d7,
        resume_token_ids=tuple(t for c in relayed for t in c.token_ids),
        resume_text_chars=sum(len(c.text) for c in relayed),
    )
    assert_same(relayed + reference(resumed), want, "d7")


TRUE = tuple(range(100, 112))  # the whole output: token t's text is chr(t)


class _Replica:
    """A replica's stream of the output after `resumed` tokens, two tokens per item (coalesced);
    before returning item `stop_at` it lets the router see its replica leave, `how` decides when."""

    def __init__(self, live, rid, resumed, stop_at=None, how=None):
        self.live, self.rid, self.cancelled = live, rid, False
        rest = TRUE[resumed:]
        self.items = [Accepted(rid)] + [
            TokenChunk(
                "r", rest[i : i + 2], "".join(map(chr, rest[i : i + 2])), None, "length" if i + 2 >= len(rest) else None
            )
            for i in range(0, len(rest), 2)
        ]
        self.stop_at, self.how, self.served = stop_at, how, 0

    async def __anext__(self):
        item = self.items.pop(0)
        if self.served == self.stop_at:
            self.live.replicas_leaving({self.rid})  # stop() is queued on this loop
            if self.how == "while_in_flight":  # stop() cancels this read: the item is never relayed
                await asyncio.sleep(0)
            # "as_it_lands": the item is returned first, then stop() finds the read already done
        self.served += 1
        return item

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("how", ["while_in_flight", "as_it_lands", "between_items"])
def test_a_stop_racing_an_item_resubmits_exactly_the_relayed_tokens(how):
    request = with_fixed_seed(GenerateRequest("r", (1, 2), SamplingParams(max_tokens=len(TRUE), temperature=0.9)))
    submitted, replicas, live = [], [], LiveStreams()

    def submit(r):
        submitted.append(r)
        first = not replicas
        stop_at = 3 if first and how != "between_items" else None  # the 3rd item after Accepted
        replicas.append(_Replica(live, "AB"[len(replicas)], len(r.resume_token_ids), stop_at, how))
        return replicas[-1]

    async def go():
        stream = await ResubmittingStream.open(submit, request, MigrationPolicy(max_migrations=2), live)
        got = []
        async for chunk in stream.chunks():
            got.append(chunk)
            if how == "between_items" and len(got) == 2:
                live.replicas_leaving({"A"})
                await asyncio.sleep(0)  # stop() runs before the next read
        return stream, got

    stream, got = asyncio.run(go())
    relayed_before_move = {"while_in_flight": 4, "as_it_lands": 6, "between_items": 4}[how]
    assert [r for r, _ in stream.moves] == ["replica_stopped"] and replicas[0].cancelled
    assert submitted[1].resume_token_ids == TRUE[:relayed_before_move]
    assert submitted[1].resume_text_chars == relayed_before_move
    assert tuple(t for c in got for t in c.token_ids) == TRUE
    assert "".join(c.text for c in got) == "".join(map(chr, TRUE)) and got[-1].finish_reason == "length"
