"""A request that ends frees its slot at once: the ConsolidatingRouter hears of the end from
Serve (on_request_completed) and offers the slot again before the replica's next report, and
a report that lists the departure is not subtracted twice. The router runs without Serve:
its replica and pending requests are stand-ins with the attributes it reads."""

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

from app.protocol import GenerateRequest
from cluster.router import ConsolidatingRouter
from cluster.stats import ARRIVALS_WINDOW_S, ReplicaStats, arrival_key


@dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


def _setup():
    replica = SimpleNamespace(replica_id=_ReplicaID("a"), routing_stats={})
    router = ConsolidatingRouter.__new__(ConsolidatingRouter)
    router.initialize_state(reserve_blocks=1, max_batch=2, block_size=16)
    router._pending_requests_to_fulfill = []
    router._replicas = {replica.replica_id: replica}
    return router, replica


def _report(replica, held, arrivals=(), departures=()):
    """A report of batch limit 2 holding ``held`` requests, listing request numbers."""
    now = time.time()
    keys = [arrival_key(f"r{i}", 0) for i in arrivals], [arrival_key(f"r{i}", 0) for i in departures]
    s = ReplicaStats(held, 0, 2, 100, 100, 16, (), False, 0.0, now, held, (), now - ARRIVALS_WINDOW_S)
    replica.routing_stats = {**s.to_dict(), "arrivals": keys[0], "departures": keys[1]}


def _offered(router, replica, i) -> bool:
    """Whether request i is offered the replica (and if so, it is routed there)."""
    pending = SimpleNamespace(
        args=[GenerateRequest(f"r{i}", (1, 2, 3))], metadata=SimpleNamespace(internal_request_id=f"i{i}"),
        routing_context=SimpleNamespace(should_backoff=False), created_at=time.time(),
    )  # fmt: skip
    order = asyncio.run(router.choose_replicas([replica], pending))
    if order:
        router.on_request_routed(pending, replica.replica_id, None)
    return bool(order)


def _ended(router, replica, i):
    router.on_request_completed(replica.replica_id, f"i{i}")


def test_an_ended_request_frees_its_slot_before_the_next_report():
    router, replica = _setup()
    _report(replica, held=0)
    assert _offered(router, replica, 1) and _offered(router, replica, 2)
    assert not _offered(router, replica, 3)  # batch 2: full until something ends or a report comes
    _ended(router, replica, 1)  # never in a report: off the sent count
    assert _offered(router, replica, 3)
    assert not _offered(router, replica, 4)


def test_a_reported_request_that_ends_is_off_the_report_until_its_departure_is_listed():
    router, replica = _setup()
    _report(replica, held=0)
    assert _offered(router, replica, 1) and _offered(router, replica, 2)
    _report(replica, held=2, arrivals=[1, 2])  # both counted by the report now
    assert not _offered(router, replica, 3)
    _ended(router, replica, 1)  # the report still holds it: subtracted from it
    assert _offered(router, replica, 3)
    assert not _offered(router, replica, 4)
    _report(replica, held=2, arrivals=[1, 2, 3], departures=[1])  # 2 and 3 held; 1's departure listed
    assert not _offered(router, replica, 4)  # 1 is not subtracted a second time
    _ended(router, replica, 2)
    assert _offered(router, replica, 4)
