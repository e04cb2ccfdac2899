"""What one request asks of a replica, as the router (cluster/router.py) reads it: a
`RoutingKey` that the request builds itself (app/protocol.py `GenerateRequest.routing_key`).

Serve hands the router the call's arguments; the first argument of LoraReplica.generate is
the request. The router reads its key through one path, `routing_key_of`: an argument that is
`Routed` gives its own key, anything else (no argument, another call) routes as the minimal
key, one batch row of one token. No Ray here, so that the request's side can build the key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RoutingKey:
    """What one request asks of a replica."""

    tokens: int = 1  # prompt + resumed tokens + the next one
    key: str = ""  # arrival_key (cluster/stats.py): how the replica's report names this submission
    adapter: str | None = None
    head: str | None = None  # prefix_head of its prompt (None: too short to name one)
    avoid: frozenset[str] = frozenset()  # failed replicas: never
    migrated_from: str | None = None  # its previous replica: only if no other has room
    rows: int = 1  # batch rows: its choices (n), which share the prompt's full blocks

    def blocks(self, block_size: int) -> int:
        """The prompt's blocks, and a tail block of its own for every further choice."""
        return math.ceil(self.tokens / block_size) + self.rows - 1


@runtime_checkable
class Routed(Protocol):
    """A request that states what it asks of a replica."""

    def routing_key(self) -> RoutingKey: ...


def routing_key_of(request: object) -> RoutingKey:
    """``request``'s own key if it is Routed, else the minimal key."""
    return request.routing_key() if isinstance(request, Routed) else RoutingKey()
