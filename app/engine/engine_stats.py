"""What an engine reports about itself, typed: EngineStats (its counters, taken after every step
for metrics, routing and autoscaling) and EngineReport (those plus its adapters, for the
replica's stats call). ``to_dict()`` is the JSON form, where one is needed: the replica's
``stats`` Serve call, which the ingress and tests read over Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    running: int  # requests in the running batch
    waiting: int  # requests queued for room
    max_batch: int  # max_num_seqs
    free_kv_blocks: int  # free to allocate (cached unreferenced blocks included)
    total_kv_blocks: int
    resident_adapters: tuple[str, ...] = ()  # adapters in GPU slots
    steps: int = 0  # forward passes, ever
    max_batch_seen: int = 0  # most requests in one forward pass
    tokens_computed: int = 0  # prefill + decode tokens through the model, ever
    preemptions: int = 0  # requests preempted because KV ran out, ever (moved or requeued)
    cached_kv_blocks: int = 0  # blocks holding a cached prefix
    prefix_hit_tokens: Mapping[str, int] = field(default_factory=dict)  # adapter ("" = base) → tokens
    prefix_query_tokens: Mapping[str, int] = field(default_factory=dict)
    prefix_heads: tuple[str, ...] = ()  # recent prompt heads (cluster/stats.py prefix_head), newest last
    kv_cache: Mapping | None = None  # the start-up's KV plan (app/engine/kv_sizing.py KvPlan.as_dict)
    startup_seconds: Mapping[str, float] | None = None  # start-up stages' wall times (app/engine/factory.py)
    deterministic: bool = False  # batch-invariant reduction orders (EngineConfig.deterministic)
    paths: Mapping[str, str] | None = None  # the op paths the model runs, by op (with deterministic)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("resident_adapters", "prefix_heads"):
            d[key] = list(d[key])
        for key in ("prefix_hit_tokens", "prefix_query_tokens"):
            d[key] = dict(d[key])
        return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class EngineReport:
    """The counters, the adapters registered, and the adapter store's tiers and counts (None for an
    engine without a store: the simulated one, benchmarks/simulated_engine.py)."""

    stats: EngineStats
    adapters: tuple[str, ...] = ()
    adapter_store: Mapping | None = None

    def to_dict(self) -> dict:
        d = {**self.stats.to_dict(), "adapters": list(self.adapters)}
        if self.adapter_store is not None:
            d["adapter_store"] = self.adapter_store
        return d
