"""The engine's written interface, as Ray Serve LLM writes its engine ABC: what a replica drives
(Engine) and what the engine loop drives (Core). The real implementations and the test double
satisfy them (tests/unit/test_engine_interface.py checks the signatures):

- Engine: AsyncEngine (app/engine/async_engine.py, the loop on a thread of the replica) and
  ProcessEngine (app/engine/process_engine.py, the loop in a child process).
- Core: EngineCore (app/engine/core.py, the model) and SimulatedCore
  (benchmarks/simulated_engine.py: the real scheduler, no model), run by either Engine.
- Model: LlamaModel (app/model/llama.py, one device) and TensorParallelModel
  (app/engine/tp/model.py, shards across GPUs), driven by EngineCore.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.scheduler import Scheduler
from app.engine.telemetry import TelemetryBatch
from app.model.config import ModelConfig
from app.model.inputs import StepInputs
from app.protocol import Chunk, GenerateRequest, Migrate


@runtime_checkable
class AdapterAccess(Protocol):
    """The engine's adapter store as the replica uses it, wherever the engine runs."""

    async def register(self, name: str, uri: str) -> None: ...

    async def unregister(self, name: str) -> None: ...

    async def load(self, name: str) -> None:
        """Fetch and validate (into host memory); raises the adapter's LoraplexError."""

    async def version(self, name: str) -> str | None: ...


@runtime_checkable
class Engine(Protocol):
    """One replica's engine."""

    store: AdapterAccess

    @property
    def idle_since(self) -> float | None:
        """Wall time the last generate() call left; None while one runs."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """The request's chunks until each choice finishes, errors or migrates; validation errors
        raise before the first chunk; leaving the iterator early aborts the request."""

    def abort(self, request_id: str) -> None: ...

    def drain(self) -> Future[int]:
        """End every stream with Migrate(reason="draining"); how many."""

    def call(self, fn: Callable, *args) -> Future:
        """fn(core, *args) on the engine loop."""

    def stats(self) -> Future[EngineReport]:
        """Counters and adapters, read on the loop (exact, not a snapshot)."""

    def metrics_sample(self) -> tuple[EngineStats, TelemetryBatch]:
        """The latest step's counters and the telemetry recorded since the previous sample."""

    def failure(self) -> str | None:
        """Why this engine can serve nothing more; None while it can."""

    def shutdown(self) -> None: ...


class AdapterLookup(Protocol):
    """What the loop and its callers use of a core's adapter store (adapters_store/store.py)."""

    async def aget(self, name: str): ...

    def get(self, name: str): ...

    def prefetch(self, name: str) -> Future: ...

    def register(self, name: str, uri) -> None: ...

    def unregister(self, name: str) -> None: ...

    def version(self, name: str) -> str | None: ...

    def names(self) -> list[str]: ...


class GuideCompiler(Protocol):
    """What callers use of a core's grammars (app/engine/grammar.py Grammars)."""

    def warm(self) -> None: ...

    def compile(self, guide): ...


@runtime_checkable
class Core(Protocol):
    """One engine's requests and step, touched by the loop's thread only (app/engine/engine_loop.py)."""

    adapters: AdapterLookup
    grammars: GuideCompiler
    scheduler: Scheduler  # its config's requeue_preempted: a lone replica recomputes a preempted request here
    idle: bool  # the latest step ran nothing (waiting for adapter copies or KV)
    last_batch_size: int  # requests in the latest forward pass
    last_preempted: int  # requests the latest step preempted

    def add(self, request: GenerateRequest, adapter=None, grammar=None) -> None:
        """Validate and queue; raises (before any compute) on bad input."""

    def abort(self, request_id: str) -> list[Chunk]: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Chunk]: ...

    def evict_all(self, reason: str) -> list[Migrate]:
        """End every request unfinished, each with a Migrate carrying its tokens so far."""

    def stats(self) -> EngineStats: ...

    def report(self) -> EngineReport: ...

    def failure(self) -> str | None: ...


@runtime_checkable
class Model(Protocol):
    """The model an EngineCore drives (its forward, run by app/engine/runner.py)."""

    cfg: ModelConfig  # a tensor-parallel model's is its shard's: KV heads per GPU
    lora_pool: object  # its adapter slots (adapters_store/gpu_pool.py); None: no adapters
    dtype: torch.dtype
    broken: BaseException | None  # the failed step that left tensor-parallel shards out of step; None on one GPU

    def forward(self, inp: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [n, vocab] (fp32) for ``inp.sample_rows``; writes this step's KV into kv_caches."""
