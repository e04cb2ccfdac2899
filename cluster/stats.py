"""The routing-stats contract: what a LoraReplica reports (`record_routing_stats`,
also the base of `record_autoscaling_stats`) and what the router reads back from
`RunningReplica.routing_stats`. One frozen dataclass both sides build and parse.

A report is read some time after it was taken, and a request the router sent shortly
before it may still be on its way through Serve. So the replica lists the requests
that reached it in the last `ARRIVALS_WINDOW_S` (`arrivals`, by `arrival_key`): the
router counts a request it sent on top of the report until the report lists it (then
`held` counts it) or until it is older than the window (then it never arrived). Likewise
the replica lists the requests that left it in the window (`departures`): a request that
ended after a report counted it is taken off that report (the router hears of the end from
Serve at once) until a report lists its departure, so a slot freed between two reports is
offered again at once, not a polling period later.

A replica also lists the prefix heads (`prefix_head`) of the requests it admitted most
recently: their KV is likely in its prefix cache, which the router uses to break ties."""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from dataclasses import dataclass

ARRIVALS_WINDOW_S = 5.0  # how far back a report lists arrivals: far above Serve's transit time
HEAD_TOKENS = 32  # prompt tokens that name a prefix head: a tenant's system prompt starts there


def arrival_key(request_id: str, resumed_tokens: int) -> str:
    """One submission of a request (a migrated request arrives again with more tokens)."""
    return f"{request_id}+{resumed_tokens}"


def prefix_head(adapter: str | None, prompt_token_ids) -> str | None:
    """A short name for (adapter, first HEAD_TOKENS prompt tokens); None for a shorter prompt."""
    if len(prompt_token_ids) < HEAD_TOKENS:
        return None
    digest = hashlib.sha256((adapter or "").encode() + b"\0" + array("q", prompt_token_ids[:HEAD_TOKENS]).tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ReplicaStats:
    running: int  # requests in the engine's running batch
    waiting: int  # requests queued in the engine (admission by KV / adapter slots)
    max_batch: int  # the engine's batch limit (max_num_seqs)
    free_kv_blocks: int
    total_kv_blocks: int
    block_size: int  # tokens per KV block
    resident_adapters: tuple[str, ...]  # adapters whose weights sit in a GPU pool slot
    draining: bool  # being emptied: the router sends it nothing new
    started_at: float  # wall time the replica finished starting (ties → the oldest)
    reported_at: float  # wall time of this report
    held: int  # requests inside the replica: arriving (adapter load), queued or running
    arrivals: tuple[str, ...]  # arrival_key of each request that reached it since arrivals_since
    arrivals_since: float  # reported_at - ARRIVALS_WINDOW_S
    prefix_heads: tuple[str, ...] = ()  # prefix_head of the requests admitted most recently
    departures: tuple[str, ...] = ()  # arrival_key of each request that left it since arrivals_since

    @property
    def batch(self) -> int:
        """Requests this replica holds, whatever their stage (the engine's own running +
        waiting misses those still loading their adapter)."""
        return max(self.held, self.running + self.waiting)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["resident_adapters"] = list(self.resident_adapters)
        d["arrivals"] = list(self.arrivals)
        d["prefix_heads"] = list(self.prefix_heads)
        d["departures"] = list(self.departures)
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> ReplicaStats | None:
        """None for a replica that has not reported yet (Serve gives `{}` until its first poll)."""
        if not d:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in fields}
        values["resident_adapters"] = tuple(values.get("resident_adapters", ()))
        values["arrivals"] = tuple(values.get("arrivals", ()))
        values["prefix_heads"] = tuple(values.get("prefix_heads", ()))
        values["departures"] = tuple(values.get("departures", ()))
        try:
            return cls(**values)
        except TypeError:  # a report missing fields (a replica of another version): treat as unknown
            return None
