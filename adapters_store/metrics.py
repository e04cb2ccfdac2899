"""Store observability: per-tier hits/misses/evictions, bytes and latency of every
load, load errors by kind, and a progress log for long downloads.

Counts are always kept in process (``snapshot()``, used by stats and tests).
Inside a Ray Serve replica they are also exported as Prometheus metrics through
``ray.serve.metrics`` (which adds the deployment/replica tags); elsewhere the
export is a no-op, so the store never needs Ray (nor its 2 s import).
Tiers: "host", "disk" (hits/misses/evictions); loads by source: "s3", "disk",
"local" (and "gpu" for the host→GPU copy, recorded by the GPU pool), each with a
load-seconds histogram; ``publish`` sets the per-tier gauges (resident adapters,
bytes, budget) from ``AdapterStore.tiers``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter

log = logging.getLogger("loraplex.adapters")

_LATENCY_BOUNDS_S = [0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
_BYTES_BOUNDS = [float(1 << p) for p in range(16, 34, 2)]  # 64 KiB … 8 GiB


def _inside_ray() -> bool:
    ray = sys.modules.get("ray")  # imported already by any Ray worker; never imported here
    return ray is not None and ray.is_initialized()


class _RayExport:
    def __init__(self):
        from ray.serve.metrics import Counter as RayCounter
        from ray.serve.metrics import Gauge, Histogram

        def counter(name, doc, tags):
            return RayCounter(f"loraplex_adapter_{name}", description=doc, tag_keys=tags)

        self.events = counter("cache_events", "Adapter cache hits/misses/evictions", ("tier", "event"))
        self.errors = counter("load_errors", "Adapter load failures by kind", ("kind",))
        self.bytes = counter("load_bytes", "Bytes of adapter weights loaded", ("source",))
        self.seconds = Histogram(
            "loraplex_adapter_load_seconds",
            description="Adapter load latency",
            boundaries=_LATENCY_BOUNDS_S,
            tag_keys=("source",),
        )
        self.sizes = Histogram(
            "loraplex_adapter_load_size_bytes",
            description="Size of each adapter load",
            boundaries=_BYTES_BOUNDS,
            tag_keys=("source",),
        )
        self.tier = Gauge(
            "loraplex_adapter_tier",
            description="Per cache tier: resident adapters, bytes, budget",
            tag_keys=("tier", "quantity"),
        )


class StoreMetrics:
    def __init__(self, export: bool | None = None):
        """export: None = export to Prometheus only when running inside Ray."""
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._buckets: dict[str, list[int]] = {}  # source → loads per latency bucket (last: above every bound)
        self._ray = _RayExport() if (_inside_ray() if export is None else export) else None

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def event(self, tier: str, event: str) -> None:
        """event: "hit", "miss" or "eviction"."""
        self._count(f"{tier}.{event}")
        if self._ray:
            self._ray.events.inc(1, tags={"tier": tier, "event": event})

    def error(self, kind: str) -> None:
        self._count(f"error.{kind}")
        if self._ray:
            self._ray.errors.inc(1, tags={"kind": kind})

    def load(self, source: str, nbytes: int, seconds: float) -> None:
        self._count(f"load.{source}")
        self._count(f"load.{source}.bytes", nbytes)
        self._count(f"load.{source}.seconds", seconds)
        with self._lock:
            buckets = self._buckets.setdefault(source, [0] * (len(_LATENCY_BOUNDS_S) + 1))
            buckets[next((i for i, b in enumerate(_LATENCY_BOUNDS_S) if seconds <= b), len(_LATENCY_BOUNDS_S))] += 1
        if self._ray:
            tags = {"source": source}
            self._ray.bytes.inc(nbytes, tags=tags)
            self._ray.seconds.observe(seconds, tags=tags)
            self._ray.sizes.observe(nbytes, tags=tags)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def histograms(self) -> dict[str, dict[str, int]]:
        """Load seconds by source: {source: {"le_<bound>": loads, …, "le_inf": loads}} (not cumulative)."""
        labels = [f"le_{b:g}" for b in _LATENCY_BOUNDS_S] + ["le_inf"]
        with self._lock:
            return {src: dict(zip(labels, counts)) for src, counts in self._buckets.items()}

    def publish(self, tiers: dict[str, dict]) -> None:
        """Set the per-tier gauges (Prometheus inside Ray; a no-op elsewhere)."""
        if self._ray:
            for tier, values in tiers.items():
                for quantity in ("resident", "bytes", "budget_bytes"):
                    self._ray.tier.set(values[quantity], tags={"tier": tier, "quantity": quantity})


class Progress:
    """Logs a long download every ``every_s`` seconds: bytes so far, total, rate."""

    def __init__(self, what: str, total: int, every_s: float):
        self.what, self.total, self.every_s = what, total, every_s
        self.done = 0
        self.start = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e6
            log.info(
                "downloading %s: %.1f / %.1f MB (%.0f%%, %.1f MB/s)",
                self.what,
                self.done / 1e6,
                self.total / 1e6,
                100 * self.done / max(self.total, 1),
                rate,
            )
