"""Punica's consolidating request router for LoraReplica.

A request goes to the replica with the *largest* current batch that still has room
(batch below its limit and enough free KV blocks for the prompt plus a reserve), except
that the newest replica goes last: Serve's downscale stops the newest first
(`deployment_scheduler._get_replicas_to_stop`, by the order replicas became running, which
is the order of the replica list Serve gives the router), so it is fed only when no other
replica has room, and it empties first as load falls. Ties → one that recently admitted a
request of the same adapter and prefix head (its prefix cache likely holds that prompt's
KV: cluster/stats.py prefix_head), then the oldest replica; among equals, one where the
adapter is already resident. Replica stats are stale by up to the polling period, so the
router counts each request on the replica it chose for it, from the moment it chose it
until the replica's report lists the request among its arrivals (cluster/stats.py); a
request that ends is taken off the count at once (Serve tells the router), off the report
until a report lists its departure. No replica with room → the request waits and Serve
retries it (every 10–100 ms) until one has room; `max_queued_requests` bounds that queue.
Waiting requests are retried in arrival order as far as Serve's routing tasks go (at most
two per replica at once): a strict first-come-first-served gate here would deadlock, since
the oldest waiting request need not hold a routing task.

A replica that leaves the running set while requests routed to it are unfinished, and was
not seen to die, was released busy: `loraplex_autoscaler_busy_releases` counts it (its
streams move to other replicas: the router tells the object registered with
cluster/leaving.py `register_streams`, app/openai/live_streams.py). The autoscaler
(cluster/autoscaling.py) is built so that it stays 0. That process-level state lives in
cluster/leaving.py, not here: Serve pickles this module by value (see there).

`rank` is the whole policy as a pure function (tested without Ray) of the replicas' views
and the request's `RoutingKey` (cluster/routing_key.py); `ConsolidatingRouter` feeds it
from Serve and follows its order.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from ray.serve.metrics import Counter, Gauge, Histogram
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.leaving import record_busy_release, replicas_left
from cluster.routing_key import RoutingKey, routing_key_of
from cluster.stats import ARRIVALS_WINDOW_S, ReplicaStats

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it: its last report plus what was sent since."""

    replica_id: str
    stats: ReplicaStats | None  # None until its first report
    sent: int = 0  # batch rows routed to it that the report does not count, less those that ended since
    sent_blocks: int = 0  # KV blocks the same requests need (negative: freed since the report)
    position: int | None = None  # in Serve's running order, oldest 0 (None: by started_at)

    def age(self) -> float:
        """Larger is newer, as Serve orders replicas for a scale-down (unreported = newest)."""
        if self.position is not None:
            return float(self.position)
        return self.stats.started_at if self.stats else math.inf


@dataclass(frozen=True)
class Policy:
    reserve_blocks: int = 1  # free KV blocks a replica must keep beyond the prompt's
    max_batch: int = 16  # assumed for a replica that has not reported yet
    block_size: int = 16  # likewise


def _room(v: ReplicaView, need: RoutingKey, p: Policy) -> bool:
    s = v.stats
    if s is None:
        return v.sent + need.rows <= p.max_batch
    return (
        not s.draining
        and s.batch + v.sent + need.rows <= s.max_batch
        and s.free_kv_blocks - v.sent_blocks >= need.blocks(s.block_size) + p.reserve_blocks
    )


def _key(v: ReplicaView, need: RoutingKey, newest: str | None):
    s = v.stats
    batch = v.sent + (s.batch if s else 0)
    resident = bool(s and need.adapter and need.adapter in s.resident_adapters)
    warm = bool(s and need.head and need.head in s.prefix_heads)
    return v.replica_id == newest, -batch, not warm, v.age(), not resident, v.replica_id


def next_to_stop(views: list[ReplicaView]) -> str | None:
    """The replica a scale-down stops first (the newest of those serving); None with one."""
    serving = [v for v in views if not (v.stats and v.stats.draining)]
    return max(serving, key=ReplicaView.age).replica_id if len(serving) > 1 else None


def rank(views: list[ReplicaView], need: RoutingKey, policy: Policy) -> list[str]:
    """Replica ids with room for ``need``, best first (empty: the request must wait)."""
    roomy = [v for v in views if v.replica_id not in need.avoid and _room(v, need, policy)]
    elsewhere = [v for v in roomy if v.replica_id != need.migrated_from]
    newest = next_to_stop(views)
    return [v.replica_id for v in sorted(elsewhere or roomy, key=lambda v: _key(v, need, newest))]


def unreported(
    sent: list[tuple[float, str, int, int]], stats: ReplicaStats | None
) -> list[tuple[float, str, int, int]]:
    """Of the (sent at, key, blocks, rows) routed to a replica, those its report does not count:
    not listed as arrived, and recent enough that they may still be on their way."""
    if stats is None:
        return sent
    arrived = set(stats.arrivals)
    return [e for e in sent if e[1] not in arrived and e[0] >= stats.arrivals_since]


def undeparted(
    ended: list[tuple[float, str, int, int]], stats: ReplicaStats | None
) -> list[tuple[float, str, int, int]]:
    """Of the (ended at, key, blocks, rows) that ended on a replica after its report counted
    them, those the report still counts: departure not listed, and recent."""
    if stats is None:
        return []
    gone = set(stats.departures)
    return [e for e in ended if e[1] not in gone and e[0] >= stats.arrivals_since]


def key_of(pending: PendingRequest | None) -> RoutingKey:
    """The routing key of the call's first argument (LoraReplica.generate's GenerateRequest)."""
    return routing_key_of(pending.args[0] if pending is not None and pending.args else None)


class ConsolidatingRouter(RequestRouter):
    """Configured by `request_router_kwargs` (reserve_blocks, max_batch, block_size)."""

    def initialize_state(self, reserve_blocks: int = 1, max_batch: int = 16, block_size: int = 16):
        self.policy = Policy(reserve_blocks, max_batch, block_size)
        self._sent: dict[str, list[tuple[float, str, int, int]]] = defaultdict(
            list
        )  # replica → [(sent at, key, blocks, rows)]
        # Serve sends to the chosen replica and waits for it to accept (a round trip) before it
        # reports the request routed, and routes several requests at once: a request counts on
        # the replica chosen for it from the moment it is chosen, or a burst lands on one replica
        self._chosen: dict[int, tuple[str, tuple[float, str, int, int]]] = {}  # id(pending) → (replica, sent entry)
        self._routed_ids: dict[str, tuple[str, tuple[float, str, int, int]]] = {}  # internal request id → same
        self._ended: dict[str, list[tuple[float, str, int, int]]] = defaultdict(list)  # replica → [(ended at, …)]
        self._order: dict[str, int] = {}  # replica → position in Serve's running order (oldest 0)
        self._died: set[str] = set()  # replicas a request found dead: their leaving is no release
        self._busy_releases = Counter(
            "loraplex_autoscaler_busy_releases", "replicas that left the running set holding requests routed to them"
        )
        self._routed = Counter(
            "loraplex_router_requests_routed", "requests routed, by replica", tag_keys=("target_replica",)
        )
        self._queue = Gauge("loraplex_router_queue_length", "requests waiting for a replica with room")
        self._wait = Histogram(
            "loraplex_router_wait_for_room_s",
            "time a request waited for a replica with room",
            boundaries=[0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30],
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Serve retries without sleeping unless told to back off (its locality mixin sets
            # this; this router has none): a busy loop that starves the router's event loop
            pending_request.routing_context.should_backoff = True
            # routed again (the last choice was full or rejected it): that choice no longer counts
            self._uncount(self._chosen.pop(id(pending_request), None))
        self._queue.set(sum(not p.future.done() for p in self._pending_requests_to_fulfill))
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        need = key_of(pending_request)
        order = rank(views, need, self.policy)
        log.debug(
            "route %s: candidates %s -> %s",
            getattr(pending_request and pending_request.metadata, "request_id", "?"),
            [(v.replica_id, v.stats.batch if v.stats else None, v.sent) for v in views],
            order or "wait",
        )
        if order and pending_request is not None:
            entry = self._entry(need)
            self._sent[order[0]].append(entry)
            self._chosen[id(pending_request)] = (order[0], entry)
        # one replica per rank: Serve picks the least loaded *within* a rank, which would undo the policy
        return [[by_id[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid = replica_id.unique_id
        chosen = self._chosen.pop(id(pending_request), None)
        if chosen is None or chosen[0] != rid:  # sent to a later rank: count it there instead
            self._uncount(chosen)
            chosen = (rid, self._entry(key_of(pending_request)))
            self._sent[rid].append(chosen[1])
        self._routed_ids[pending_request.metadata.internal_request_id] = chosen
        horizon = time.time() - ARRIVALS_WINDOW_S  # choices never reported routed (rejected, cancelled)
        self._chosen = {k: c for k, c in self._chosen.items() if c[1][0] >= horizon}
        self._routed.inc(tags={"target_replica": rid})
        self._wait.observe(max(0.0, time.time() - pending_request.created_at))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Its slot is free now: off the sent count if no report counted it yet, else off the
        report until a report lists its departure."""
        rid, entry = self._routed_ids.pop(internal_request_id, (None, None))
        if entry is None or rid != replica_id.unique_id:
            return
        replica = self._replicas.get(replica_id)
        stats = ReplicaStats.from_dict(replica.routing_stats) if replica is not None else None
        sent = self._sent[rid] = unreported(self._sent.get(rid, []), stats)
        if entry in sent:
            sent.remove(entry)
        else:
            self._ended[rid].append((time.time(), *entry[1:]))

    def on_replica_actor_died(self, replica_id) -> None:
        self._died.add(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self._replica_id_set} | set(self._order)
        super().update_replicas(replicas)
        self._order = {r.replica_id.unique_id: i for i, r in enumerate(replicas)}
        gone = before - set(self._order)
        self._count_busy_releases(gone)
        for rid in gone:
            self._sent.pop(rid, None)
            self._ended.pop(rid, None)
        self._routed_ids = {k: c for k, c in self._routed_ids.items() if c[0] not in gone}
        if gone:  # stopped by a scale-down (or dead): streams still on them move now
            replicas_left(gone)

    def _count_busy_releases(self, gone: set[str]) -> None:
        """A replica that left holding requests this router sent it, not seen dead: released busy."""
        for rid in gone - self._died:
            cut = sum(1 for r, _ in self._routed_ids.values() if r == rid)
            if cut:
                record_busy_release(rid, cut)
                self._busy_releases.inc()
                log.warning("replica %s left the running set with %d request(s) routed to it unfinished", rid, cut)
        self._died -= gone

    def _entry(self, need: RoutingKey) -> tuple[float, str, int, int]:
        return time.time(), need.key, need.blocks(self.policy.block_size), need.rows

    def _uncount(self, chosen: tuple[str, tuple[float, str, int, int]] | None) -> None:
        if chosen is not None and chosen[1] in self._sent.get(chosen[0], ()):
            self._sent[chosen[0]].remove(chosen[1])

    def _view(self, replica: RunningReplica) -> ReplicaView:
        rid = replica.replica_id.unique_id
        stats = ReplicaStats.from_dict(replica.routing_stats)
        sent = self._sent[rid] = unreported(self._sent.get(rid, []), stats)
        ended = self._ended[rid] = undeparted(self._ended.get(rid, []), stats)
        rows = sum(e[3] for e in sent) - sum(e[3] for e in ended)
        blocks = sum(e[2] for e in sent) - sum(e[2] for e in ended)
        return ReplicaView(rid, stats, rows, blocks, self._order.get(rid))
