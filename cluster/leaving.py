"""Replicas leaving the running set, as the routers of this process see them: the one object
registered to move their streams, and the busy releases (replicas that left holding requests).

Process-level state, kept out of cluster/router.py on purpose: Serve builds each router itself,
inside the caller's process, from the deployment's `request_router_class`, so the caller (the
Ingress) cannot hand a router anything; and Serve ships that class pickled *by value* with its
module (ray/serve/config.py `_serialize_request_router_cls`), so a router's module globals are
copies taken when the deployment was configured. Functions of this module are pickled by
reference: a router calling them reaches the process's real state."""

from __future__ import annotations

import time
from typing import Protocol


class StreamsByReplica(Protocol):
    """The caller's side of the replica calls (app/openai/live_streams.py): what moves the
    streams of replicas that leave."""

    def replicas_leaving(self, replica_ids: set[str]) -> None:
        """Called on a router's event loop, not the caller's."""


_streams: StreamsByReplica | None = None  # the one registered
_busy_releases: list[tuple[float, str, int]] = []  # (when, replica, unfinished requests)


def register_streams(streams: StreamsByReplica | None) -> None:
    """The object every router of this process tells of replicas leaving (None: none). A later
    call replaces the earlier: one Ingress per process."""
    global _streams
    _streams = streams


def replicas_left(replica_ids: set[str]) -> None:
    """A router saw these replicas leave the running set: the registered streams on them move."""
    if _streams is not None:
        _streams.replicas_leaving(replica_ids)


def record_busy_release(replica_id: str, cut: int) -> None:
    _busy_releases.append((time.time(), replica_id, cut))


def busy_releases() -> list[tuple[float, str, int]]:
    """Every busy release the routers of this process saw: (when, replica id, requests cut)."""
    return list(_busy_releases)
