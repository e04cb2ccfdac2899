"""Engine metrics of one replica on Ray's Prometheus endpoint (what vLLM's /metrics shows).

A daemon thread drains the engine's plain telemetry (app/engine/telemetry.py)
every ``interval_s`` and publishes it through ``ray.serve.metrics``, which tags
every series with the deployment, replica and application. Names (Prometheus
adds Ray's ``ray_`` prefix, and ``_total`` / ``_bucket`` suffixes):

  loraplex_engine_requests_running, _requests_waiting        gauges
  loraplex_engine_kv_blocks_used, _kv_blocks_total            gauges
  loraplex_engine_kv_blocks_free, _kv_blocks_cached           gauges (free counts unreferenced cached blocks)
  loraplex_engine_kv_cache_bytes                              gauge: the KV cache's memory (auto-sized on CUDA)
  loraplex_engine_prefix_cache_hit_tokens{adapter}            counter: prompt tokens read from the prefix cache
  loraplex_engine_prefix_cache_query_tokens{adapter}          counter: prompt tokens of requests looked up
  loraplex_engine_batch_size, _step_seconds                   histograms, one sample per step
  loraplex_engine_time_to_first_token_seconds                 histogram (arrival at the replica → first token)
  loraplex_engine_time_per_output_token_seconds               histogram (gap between two tokens)
  loraplex_engine_prompt_tokens, _generation_tokens           counters
  loraplex_engine_preemptions                                 counter (KV exhausted)
  loraplex_engine_migrations{reason}                          counter (requests that left unfinished)
  loraplex_engine_requests_finished{finish_reason}            counter
  loraplex_engine_requests{adapter}                           counter; bounded labels, see AdapterLabels
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from app.engine.engine_stats import EngineStats
from app.engine.telemetry import TelemetryBatch

log = logging.getLogger("ray.serve")

_BATCH_BOUNDS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
_STEP_BOUNDS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]
_TTFT_BOUNDS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
_TPOT_BOUNDS_S = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5]
BASE_MODEL_LABEL = "base"
OTHER_LABEL = "other"


class AdapterLabels:
    """Bounded label cardinality for per-adapter counts: at most ``n`` adapters ever get
    their own label — each while it is among the ``n`` most requested on this replica so
    far and a label is still free; every other request counts under ``other``."""

    def __init__(self, n: int = 16):
        self.n = n
        self.counts: Counter[str] = Counter()
        self.labelled: set[str] = set()

    def label(self, adapter: str, requests: int) -> str:
        self.counts[adapter] += requests
        if adapter in self.labelled:
            return adapter
        top = {name for name, _ in self.counts.most_common(self.n)}
        if adapter in top and len(self.labelled) < self.n:
            self.labelled.add(adapter)
            return adapter
        return OTHER_LABEL

    def of(self, adapter: str) -> str:
        """The label ``adapter`` counts under now, without counting a request."""
        return adapter if adapter in self.labelled else OTHER_LABEL


class EngineMetrics:
    def __init__(self, engine, interval_s: float = 1.0, adapter_labels: int = 16):
        """engine: the replica's AsyncEngine or ProcessEngine (its ``metrics_sample()``)."""
        from ray.serve.metrics import Counter as RayCounter
        from ray.serve.metrics import Gauge, Histogram

        def name(s):
            return f"loraplex_engine_{s}"

        self.engine = engine
        self.interval_s = interval_s
        self.adapters = AdapterLabels(adapter_labels)
        self.running = Gauge(name("requests_running"), description="Requests in the running batch")
        self.waiting = Gauge(name("requests_waiting"), description="Requests queued in the engine for room")
        self.kv_used = Gauge(name("kv_blocks_used"), description="KV cache blocks in use")
        self.kv_total = Gauge(name("kv_blocks_total"), description="KV cache blocks of this replica")
        self.kv_free = Gauge(
            name("kv_blocks_free"), description="KV blocks free to allocate (cached unreferenced included)"
        )
        self.kv_cached = Gauge(name("kv_blocks_cached"), description="KV blocks holding a cached prefix")
        self.kv_bytes = Gauge(name("kv_cache_bytes"), description="GPU memory of the KV cache (sized at start-up)")
        self.prefix = {  # engine stats key → counter; the engine's totals are cumulative
            "prefix_hit_tokens": RayCounter(
                name("prefix_cache_hit_tokens"),
                tag_keys=("adapter",),
                description="Prompt tokens whose KV came from the prefix cache",
            ),
            "prefix_query_tokens": RayCounter(
                name("prefix_cache_query_tokens"),
                tag_keys=("adapter",),
                description="Prompt tokens of requests looked up in the prefix cache",
            ),
        }
        self._prefix_seen: dict[str, Counter] = {key: Counter() for key in self.prefix}
        self.batch = Histogram(
            name("batch_size"), description="Requests in each forward pass", boundaries=_BATCH_BOUNDS
        )
        self.step = Histogram(name("step_seconds"), description="Time of one engine step", boundaries=_STEP_BOUNDS_S)
        self.ttft = Histogram(
            name("time_to_first_token_seconds"),
            boundaries=_TTFT_BOUNDS_S,
            description="Arrival at the replica to the first token",
        )
        self.tpot = Histogram(
            name("time_per_output_token_seconds"),
            boundaries=_TPOT_BOUNDS_S,
            description="Time between two tokens of one request",
        )
        self.prompt_tokens = RayCounter(name("prompt_tokens"), description="Prompt tokens of requests received")
        self.generation_tokens = RayCounter(name("generation_tokens"), description="Tokens generated")
        self.preemptions = RayCounter(name("preemptions"), description="Requests evicted because KV ran out")
        self.migrations = RayCounter(
            name("migrations"), description="Requests that left unfinished", tag_keys=("reason",)
        )
        self.finished = RayCounter(
            name("requests_finished"), description="Requests ended here", tag_keys=("finish_reason",)
        )
        self.requests = RayCounter(name("requests"), description="Requests received, by adapter", tag_keys=("adapter",))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-metrics", daemon=True)

    def start(self) -> EngineMetrics:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # metrics must never take the replica down
                log.exception("publishing engine metrics failed")

    def publish(self) -> None:
        s, batch = self.engine.metrics_sample()  # from the engine process, if it has one
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_used.set(s.total_kv_blocks - s.free_kv_blocks)
        self.kv_total.set(s.total_kv_blocks)
        self.kv_free.set(s.free_kv_blocks)
        self.kv_cached.set(s.cached_kv_blocks)
        if s.kv_cache is not None:  # the start-up's KV plan (app/engine/kv_sizing.py)
            self.kv_bytes.set(s.kv_cache["bytes"])
        self._publish(batch)
        self._publish_prefix(s)

    def _publish_prefix(self, s: EngineStats) -> None:
        totals = {"prefix_hit_tokens": s.prefix_hit_tokens, "prefix_query_tokens": s.prefix_query_tokens}
        for key, counter in self.prefix.items():
            seen = self._prefix_seen[key]
            for adapter, total in totals[key].items():
                if total > seen[adapter]:
                    counter.inc(total - seen[adapter], tags={"adapter": self.adapters.of(adapter or BASE_MODEL_LABEL)})
                    seen[adapter] = total

    def _publish(self, b: TelemetryBatch) -> None:
        for hist, values in (
            (self.batch, b.batch_sizes),
            (self.step, b.step_seconds),
            (self.ttft, b.ttft_seconds),
            (self.tpot, b.tpot_seconds),
        ):
            for v in values:
                hist.observe(v)
        for counter, n in (
            (self.prompt_tokens, b.prompt_tokens),
            (self.generation_tokens, b.generation_tokens),
            (self.preemptions, b.preemptions),
        ):
            if n:
                counter.inc(n)
        for reason, n in b.migrations.items():
            self.migrations.inc(n, tags={"reason": reason})
        for reason, n in b.finished.items():
            self.finished.inc(n, tags={"finish_reason": reason})
        for adapter, n in b.adapter_requests.items():
            self.requests.inc(n, tags={"adapter": self.adapters.label(adapter or BASE_MODEL_LABEL, n)})
