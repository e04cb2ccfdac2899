"""The routing policy and the migration bounds, without Ray Serve running."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from app.openai.client_stream import MigrationPolicy, ResubmittingStream, with_fixed_seed
from app.openai.live_streams import LiveStreams
from app.protocol import Accepted, ErrorChunk, GenerateRequest, Migrate, SamplingParams, TokenChunk
from cluster.leaving import register_streams
from cluster.router import Policy, ReplicaView, key_of, rank
from cluster.routing_key import RoutingKey
from cluster.stats import ReplicaStats, arrival_key, prefix_head

POLICY = Policy(reserve_blocks=1, max_batch=4, block_size=16)


def stats(running=0, waiting=0, free=100, started=0.0, adapters=(), draining=False, max_batch=4):
    return ReplicaStats(
        running, waiting, max_batch, free, 100, 16, tuple(adapters), draining, started, 1.0, running + waiting, (), -4.0
    )


def test_busiest_with_room_first_then_oldest_and_the_newest_last():
    views = [
        ReplicaView("a", stats(1, started=1)),
        ReplicaView("b", stats(3, started=2)),
        ReplicaView("c", stats(1, started=0)),
        ReplicaView("d", stats(4, started=0)),
        ReplicaView("e", stats(0, started=3)),
    ]
    assert rank(views, RoutingKey(10), POLICY) == ["b", "c", "a", "e"]  # d is full


def test_the_replica_a_scale_down_stops_first_is_fed_only_when_no_other_has_room():
    # Serve's running order (position) decides, not the reported start time: Ray stops the last
    views = [
        ReplicaView("old", stats(1, started=5.0), position=0),
        ReplicaView("new", stats(3, started=1.0), position=1),
    ]
    assert rank(views, RoutingKey(10), POLICY) == ["old", "new"]  # busier, but Ray would stop it: it empties
    full = [ReplicaView("old", stats(4), position=0), views[1]]
    assert rank(full, RoutingKey(10), POLICY) == ["new"]
    draining = [views[0], ReplicaView("new", stats(3, draining=True), position=1)]
    assert rank(draining, RoutingKey(10), POLICY) == ["old"]
    assert rank(views[:1], RoutingKey(10), POLICY) == ["old"]  # alone: nothing to stop


def test_counts_what_was_sent_since_the_report():
    views = [ReplicaView("a", stats(2, started=0), sent=2), ReplicaView("b", stats(1, started=1))]
    assert rank(views, RoutingKey(10), POLICY) == ["b"]


def test_kv_room_includes_prompt_and_reserve():
    # 40 tokens = 3 blocks, + 1 reserve = 4 needed
    views = [
        ReplicaView("a", stats(3, free=3)),
        ReplicaView("b", stats(0, free=10, started=5)),
        ReplicaView("c", stats(2, free=6), sent=1, sent_blocks=3),
    ]
    assert rank(views, RoutingKey(40), POLICY) == ["b"]
    assert rank([ReplicaView("a", stats(3, free=4))], RoutingKey(40), POLICY) == ["a"]


def test_a_request_of_n_choices_needs_n_rows_and_a_tail_block_per_further_choice():
    # 3 choices of 40 tokens: 3 rows; 3 prompt blocks + 2 tails + 1 reserve = 6 blocks
    views = [
        ReplicaView("a", stats(2, free=50)),
        ReplicaView("b", stats(1, free=5, started=1)),
        ReplicaView("c", stats(1, free=6, started=2)),
    ]
    assert rank(views, RoutingKey(40, rows=3), POLICY) == ["c"]
    assert rank([ReplicaView("new", None, sent=2)], RoutingKey(10, rows=3), POLICY) == []  # 2 sent + 3 > 4


def test_resident_adapter_breaks_ties_draining_and_avoided_get_nothing():
    views = [
        ReplicaView("a", stats(2, started=0)),
        ReplicaView("b", stats(2, started=0, adapters=["x"])),
        ReplicaView("c", stats(3, draining=True)),
    ]
    assert rank(views, RoutingKey(5, adapter="x"), POLICY) == ["b", "a"]
    assert rank(views, RoutingKey(5, adapter="x", avoid=frozenset({"b"})), POLICY) == ["a"]


def test_migration_source_only_when_nothing_else_has_room():
    views = [ReplicaView("a", stats(3, started=0)), ReplicaView("b", stats(0, started=1))]
    assert rank(views, RoutingKey(5, migrated_from="a"), POLICY) == ["b"]
    assert rank(views[:1], RoutingKey(5, migrated_from="a"), POLICY) == ["a"]


def test_unreported_replica_ranks_as_newest_empty():
    views = [ReplicaView("new", None), ReplicaView("old", stats(0, started=0))]
    assert rank(views, RoutingKey(5), POLICY) == ["old", "new"]
    assert rank([ReplicaView("new", None, sent=4)], RoutingKey(5), POLICY) == []


def test_a_request_routes_by_its_own_key_and_anything_else_by_the_minimal_one():
    prompt = tuple(range(40))
    request = GenerateRequest(
        "r", prompt, adapter="t", resume_token_ids=(7, 8), avoid_replicas=("a",), migrated_from="b", n=3
    )
    want = RoutingKey(43, arrival_key("r", 2), "t", prefix_head("t", prompt), frozenset({"a"}), "b", 3)
    assert key_of(SimpleNamespace(args=[request])) == want
    duck = SimpleNamespace(prompt_token_ids=prompt, routing_key=None)  # not a Routed request
    assert key_of(SimpleNamespace(args=[duck])) == key_of(SimpleNamespace(args=[])) == key_of(None) == RoutingKey()


def test_sent_requests_count_until_the_report_lists_their_arrival():
    import dataclasses

    from cluster.router import unreported

    report = dataclasses.replace(stats(1), arrivals=("r1+0",), arrivals_since=10.0)
    sent = [(9.0, "lost+0", 1), (11.0, "r1+0", 1), (11.5, "r2+0", 2), (12.0, "r1+3", 1)]
    # r1's first submission is in the report; r2 and r1's resumed submission are on their way
    assert unreported(sent, report) == sent[2:]
    assert unreported(sent, None) == sent


def test_stats_round_trip_and_unknown():
    s = stats(2, 1, adapters=["x"])
    assert ReplicaStats.from_dict(s.to_dict()) == s and s.batch == 3
    assert ReplicaStats.from_dict({}) is None and ReplicaStats.from_dict({"running": 1}) is None


def test_the_router_serve_ships_tells_this_process_registered_streams():
    """Serve pickles the router's module by value (its globals are copies): what it calls on
    replicas leaving must still reach the object registered in this process."""
    from ray.serve.config import RequestRouterConfig

    shipped = RequestRouterConfig(request_router_class="cluster.router:ConsolidatingRouter").get_request_router_class()
    told = []

    class Streams:
        def replicas_leaving(self, replica_ids):
            told.append(replica_ids)

    register_streams(Streams())
    try:
        shipped.update_replicas.__globals__["replicas_left"]({"a"})
    finally:
        register_streams(None)
    assert told == [{"a"}]


# -- ResubmittingStream against scripted replicas ------------------------------------


def test_replicas_leaving_stops_their_streams_on_their_own_loop():
    live, stopped = LiveStreams(), []

    async def go():
        loop = asyncio.get_running_loop()

        class Stream:  # as a ResubmittingStream: its loop and stop()
            def __init__(self, name):
                self.loop, self.name = loop, name

            def stop(self):
                stopped.append((self.name, threading.get_ident()))

        streams = {name: Stream(name) for name in "abcd"}
        for name, replica in zip("abcd", "AABA"):
            live.add(replica, streams[name])
        live.discard("A", streams["d"])  # its call ended: not listed any more
        # a router calls from its own thread; stop() is queued on this loop before the call returns
        await loop.run_in_executor(None, live.replicas_leaving, {"A", "Z"})

    asyncio.run(go())
    assert sorted(stopped) == [("a", threading.get_ident()), ("b", threading.get_ident())]


class _Script:
    """A stand-in for a replica's DeploymentResponseGenerator."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            await asyncio.sleep(3600)  # a replica that never answers
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _request(**kw):
    return with_fixed_seed(GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=4, **kw)))


def _run(scripts, policy=MigrationPolicy(max_migrations=3, failover_wait_s=0.2)):
    submitted = []

    def submit(request):
        submitted.append(request)
        return scripts.pop(0)

    async def go():
        stream = await ResubmittingStream.open(submit, _request(), policy, LiveStreams())
        return [c async for c in stream.chunks()]

    return asyncio.run(go()), submitted


def _tok(t, text, finish=None):
    return TokenChunk("r", (t,), text, None, finish)


def test_failover_resubmits_relayed_tokens_and_excludes_the_dead_replica():
    chunks, submitted = _run(
        [
            _Script([Accepted("A"), _tok(7, "x"), ActorDiedError()]),
            _Script([Accepted("B"), _tok(8, "y"), _tok(9, "z", "length")]),
        ]
    )
    assert [c.token_ids for c in chunks] == [(7,), (8,), (9,)]
    again = submitted[1]
    assert again.resume_token_ids == (7,) and again.resume_text_chars == 1
    assert again.avoid_replicas == ("A",) and again.params.seed == submitted[0].params.seed is not None


def test_migrate_chunk_moves_with_source_soft_avoided():
    chunks, submitted = _run(
        [
            _Script([Accepted("A"), _tok(7, "x"), Migrate("r", (1, 2, 3), (7,), 5, "kv_cache_exhausted")]),
            _Script([Accepted("B"), _tok(8, "y", "stop")]),
        ]
    )
    assert [c.text for c in chunks] == ["x", "y"]
    assert submitted[1].migrated_from == "A" and submitted[1].avoid_replicas == ()


def test_a_request_that_fits_nowhere_ends_with_an_error_after_the_bound():
    migrate = Migrate("r", (1, 2, 3), (), 5, "kv_cache_exhausted")
    chunks, submitted = _run([_Script([Accepted(f"R{i}"), migrate]) for i in range(5)])
    assert len(submitted) == 4 and isinstance(chunks[-1], ErrorChunk)
    assert "max_migrations" in chunks[-1].message and chunks[-1].status == 503


def test_no_replacement_within_the_wait_bound_is_an_explicit_error():
    chunks, _ = _run([_Script([Accepted("A"), _tok(7, "x"), ActorDiedError()]), _Script([])])
    assert isinstance(chunks[-1], ErrorChunk) and "within 0.2 s" in chunks[-1].message


def test_user_seed_is_kept():
    assert _request(seed=11).params.seed == 11
    with pytest.raises(TypeError):  # a replica stream must start with Accepted
        _run([_Script([_tok(1, "a", "stop")])])
