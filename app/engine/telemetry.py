"""What the engine measures about itself, in plain Python (no Ray here).

The engine thread records each step and each token delivery into an
EngineTelemetry; an exporter (app/serving/engine_metrics.py inside a Serve replica)
takes what accumulated with ``drain()`` once a second and publishes it. Recording
is a few list appends under a lock, so a step pays no metrics-library cost.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TelemetryBatch:
    """Everything recorded since the previous drain."""

    batch_sizes: list[int] = field(default_factory=list)  # requests in each forward pass
    step_seconds: list[float] = field(default_factory=list)
    ttft_seconds: list[float] = field(default_factory=list)  # arrival at this engine → first token
    tpot_seconds: list[float] = field(default_factory=list)  # gap between two tokens of one request
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0  # KV exhausted: the newest request was evicted
    migrations: Counter = field(default_factory=Counter)  # reason → requests that left this engine unfinished
    finished: Counter = field(default_factory=Counter)  # finish reason → requests
    adapter_requests: Counter = field(default_factory=Counter)  # adapter name ("" = base model) → requests


class EngineTelemetry:
    def __init__(self):
        self._lock = threading.Lock()
        self._batch = TelemetryBatch()

    def step(self, batch_size: int, seconds: float) -> None:
        with self._lock:
            self._batch.batch_sizes.append(batch_size)
            self._batch.step_seconds.append(seconds)

    def request(self, adapter: str | None, prompt_tokens: int) -> None:
        with self._lock:
            self._batch.adapter_requests[adapter or ""] += 1
            self._batch.prompt_tokens += prompt_tokens

    def tokens(self, n: int, ttft: float | None = None, gap: float | None = None) -> None:
        with self._lock:
            self._batch.generation_tokens += n
            if ttft is not None:
                self._batch.ttft_seconds.append(ttft)
            if gap is not None:
                self._batch.tpot_seconds.append(gap)

    def preempted(self, n: int = 1) -> None:
        with self._lock:
            self._batch.preemptions += n

    def migrated(self, reason: str) -> None:
        with self._lock:
            self._batch.migrations[reason] += 1

    def finished(self, reason: str) -> None:
        with self._lock:
            self._batch.finished[reason] += 1

    def drain(self) -> TelemetryBatch:
        with self._lock:
            batch, self._batch = self._batch, TelemetryBatch()
        return batch
