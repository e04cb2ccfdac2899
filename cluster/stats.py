"""The routing-stats contract: what a LoraReplica reports (`record_routing_stats`,
also the base of `record_autoscaling_stats`) and what the router reads back from
`RunningReplica.routing_stats`. One frozen dataclass both sides build and parse."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    started_at: float  # wall time the replica started (ties → the oldest)
    reported_at: float  # wall time of this report: what the router sent before it is counted in it

    @property
    def batch(self) -> int:
        """Requests this replica holds (running or queued in its engine)."""
        return self.running + self.waiting

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["resident_adapters"] = list(self.resident_adapters)
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> ReplicaStats | None:
        """None for a replica that has not reported yet (Serve gives `{}` until its first poll)."""
        if not d:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in fields}
        values["resident_adapters"] = tuple(values.get("resident_adapters", ()))
        try:
            return cls(**values)
        except TypeError:  # a report missing fields (a replica of another version): treat as unknown
            return None
