"""The ingress's open client streams, by the replica serving each: what moves them when their
replica leaves the running set.

One `LiveStreams` per ingress process: the Ingress makes it, passes it to every
ResubmittingStream it opens (app/openai/client_stream.py) and registers it with the routers
of its process (`cluster.leaving.register_streams`). A router that sees replicas leave (a
scale-down stops them) calls `replicas_leaving` on its own event loop, in another thread: the
map is guarded by a lock, and each stream is stopped on its own loop (`call_soon_threadsafe`),
where it cancels the replica call and re-submits before the replica dies."""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol


class Stoppable(Protocol):
    """A stream that ends its replica call as a move (ResubmittingStream)."""

    loop: asyncio.AbstractEventLoop  # the loop it runs on

    def stop(self) -> None: ...


class LiveStreams:
    """Replica id → the streams it serves."""

    def __init__(self):
        self._by_replica: dict[str, set[Stoppable]] = {}
        self._lock = threading.Lock()  # add/discard on the ingress's loop, replicas_leaving on a router's

    def add(self, replica_id: str, stream: Stoppable) -> None:
        with self._lock:
            self._by_replica.setdefault(replica_id, set()).add(stream)

    def discard(self, replica_id: str, stream: Stoppable) -> None:
        with self._lock:
            streams = self._by_replica.get(replica_id)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._by_replica[replica_id]

    def replicas_leaving(self, replica_ids: set[str]) -> None:
        """These replicas left the running set: each of their streams stops on its own loop and moves."""
        with self._lock:
            leaving = [s for rid in replica_ids for s in self._by_replica.get(rid, ())]
        for stream in leaving:
            stream.loop.call_soon_threadsafe(stream.stop)
