"""LoraReplica: the Serve deployment that owns one engine (one per GPU).

The ingress streams GenerateRequests in through a DeploymentHandle
(`.options(stream=True)`) and gets the engine's chunks back as they come.
Cancelling that stream (client gone) closes the engine iterator, which aborts
the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, replace

from ray import serve

from adapters_store.store import StoreConfig
from app.engine.async_engine import build_async_engine
from app.engine.config import EngineConfig
from app.engine.engine_stats import EngineStats
from app.engine.interface import Engine
from app.engine.startup import StartupError, startup_cause
from app.errors import AdapterNotFoundError, LoraplexError
from app.protocol import Accepted, Chunk, GenerateRequest, Migrate
from app.serving.engine_metrics import EngineMetrics
from app.serving.registry import AdapterSpec
from cluster.stats import ARRIVALS_WINDOW_S, ReplicaStats, arrival_key

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReplicaSettings:
    model: str | None  # None = the embedded default model
    engine: EngineConfig
    adapters: tuple[AdapterSpec, ...]  # registered at start-up
    migrate_locally: bool = True  # a preempted request re-queues here; False: it moves to another replica
    store: StoreConfig = StoreConfig()  # adapter tiers' budgets and the on-demand source

    @property
    def core_config(self) -> EngineConfig:
        """The config its engine's core is built with: migrate_locally as the scheduler's requeue_preempted."""
        return replace(self.engine, requeue_preempted=self.migrate_locally)


def start_engine(settings: ReplicaSettings, engine_factory: Callable, on_death: Callable[[str], None]) -> Engine:
    """The replica's engine: engine_factory(settings) in this process, or, with
    ``engine.engine_process``, in a child process of its own (app/engine/process_engine.py)."""
    if not settings.engine.engine_process:
        return engine_factory(settings)
    from app.engine.process_engine import ProcessEngine

    return ProcessEngine(engine_factory, settings, on_death)


def _engine_died(reason: str) -> None:
    """The engine process is gone (a crash, a kill): so is this replica. Exiting fails its
    streams as a lost replica's, which the Ingress resumes elsewhere by migration, and Serve
    starts a replacement; check_health says the same in case Serve asks first."""
    log.error("%s: this replica exits so that Serve replaces it", reason)
    os._exit(1)


@serve.deployment(name="LoraReplica")
class LoraReplica:
    def __init__(self, settings: ReplicaSettings, registry, engine_factory: Callable = build_async_engine):
        """registry: a handle to AdapterRegistry; engine_factory(settings) → an AsyncEngine (a seam for
        tests; with the engine process it runs there, so it must be a module-level name)."""
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.block_size = settings.engine.block_size
        try:
            self.engine: Engine = start_engine(settings, engine_factory, _engine_died)
        except Exception as exc:  # a cause the config or the hardware gives is one line, not a chain
            cause = startup_cause(exc)
            if cause is None:
                raise
            raise StartupError(cause) from None
        self.registry = registry
        self.store = self.engine.store  # the engine's AdapterStore, wherever the engine runs
        self.specs = {s.name: s for s in settings.adapters}  # what this replica registered, by name
        self.epoch = 0  # the registry epoch this replica last synced with
        self.draining = False  # set by drain(): the router sends nothing new, running requests move
        self.held = 0  # generate() calls in progress
        self.arrivals: deque[tuple[float, str]] = deque()  # (wall time, arrival_key), the last ARRIVALS_WINDOW_S
        self.departures: deque[tuple[float, str]] = deque()  # likewise, of the requests that left
        self.metrics = EngineMetrics(self.engine).start()  # the engine's Prometheus series (engine_metrics.py)
        # when it came up, as Serve orders replicas for a scale-down (newest first)
        self.started_at = time.time()

    async def generate(
        self, request: GenerateRequest, adapter: AdapterSpec | None, epoch: int
    ) -> AsyncIterator[Chunk | LoraplexError]:
        """Accepted(this replica), then the request's chunks or the LoraplexError that rejected it."""
        self.held += 1  # before the first await: a report taken from now on counts it
        key = arrival_key(request.request_id, len(request.resume_token_ids))
        self.arrivals.append((time.time(), key))
        try:
            yield Accepted(self.replica_id)
            if self.draining:  # routed here before the router saw the drain: every choice moves on at once
                for c in map(request.choice, range(request.n)):
                    yield Migrate(
                        c.request_id, c.prompt_token_ids, c.resume_token_ids, c.params.seed or 0, "draining", c.index
                    )
                return
            await self._sync(epoch)
            if adapter is not None:
                await self._ensure(adapter)
            async for chunk in self.engine.generate(request):
                yield chunk
        except LoraplexError as exc:  # bad input, not a replica failure: yielded, so Serve logs no traceback
            yield exc
        finally:
            self.held -= 1
            self.departures.append((time.time(), key))  # with held: no report counts it after this

    async def load_adapter(self, name: str, uri: str) -> str:
        """Load (and so validate) an adapter before the registry lists it: its content
        version, or InvalidAdapterError / AdapterNotFoundError."""
        self.specs.pop(name, None)  # no longer what the registry says: the next request re-registers
        await self.store.register(name, uri)
        try:
            await self.store.load(name)
        except LoraplexError:
            await self.store.unregister(name)
            raise
        return await self.store.version(name)

    async def stats(self) -> dict:
        """The engine's counters and adapters, read on its own thread (exact, not a stale snapshot),
        in JSON form (app/engine/engine_stats.py EngineReport.to_dict): the ingress and tests read it."""
        return (await asyncio.wrap_future(self.engine.stats())).to_dict()

    async def _counters(self) -> EngineStats:
        return (await asyncio.wrap_future(self.engine.stats())).stats

    async def routing_stats(self) -> ReplicaStats:
        now = time.time()
        for window in (self.arrivals, self.departures):
            while window and window[0][0] < now - ARRIVALS_WINDOW_S:
                window.popleft()
        # taken before the engine's counts
        held, arrivals, departures = self.held, tuple(k for _, k in self.arrivals), tuple(k for _, k in self.departures)
        s = await self._counters()
        return ReplicaStats(
            running=s.running,
            waiting=s.waiting,
            max_batch=s.max_batch,
            free_kv_blocks=s.free_kv_blocks,
            total_kv_blocks=s.total_kv_blocks,
            block_size=self.block_size,
            resident_adapters=s.resident_adapters,
            draining=self.draining,
            started_at=self.started_at,
            reported_at=now,
            held=held,
            arrivals=arrivals,
            arrivals_since=now - ARRIVALS_WINDOW_S,
            prefix_heads=s.prefix_heads,
            departures=departures,
        )

    async def record_routing_stats(self) -> dict:
        """Serve polls this for the request router (cluster/stats.py, the routing-stats contract)."""
        return (await self.routing_stats()).to_dict()

    async def drain(self) -> int:
        """Empty this replica: the router sends it nothing new and each running request ends
        its stream with Migrate(reason="draining"), so the ingress moves it elsewhere. The
        number of requests moved."""
        self.draining = True
        return await asyncio.wrap_future(self.engine.drain())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve pushes this to the autoscaling policy (cluster/autoscaling.py) every
        `metrics_interval_s`; idle_since is the wall time the last request left (0 while one is held)."""
        s = await self._counters()
        return {
            "running": s.running,
            "waiting": s.waiting,
            "max_batch": s.max_batch,
            "free_kv_blocks": s.free_kv_blocks,
            "total_kv_blocks": s.total_kv_blocks,
            # a request accepted here keeps the replica busy before it reaches the engine (while the
            # replica syncs the registry or loads its adapter): never released with it inside
            "idle_since": 0.0 if self.held else (self.engine.idle_since or 0.0),
            "draining": float(self.draining),
            "started_at": self.started_at,
        }

    def check_health(self) -> None:
        """Serve replaces a replica whose check raises: one whose engine process died, or whose
        tensor-parallel shards fell out of step in a failed step (app/engine/tp/model.py), can
        serve nothing more."""
        failure = self.engine.failure()
        if failure is not None:
            raise RuntimeError(failure)

    async def _ensure(self, spec: AdapterSpec) -> None:
        """Register what the registry says under this name (a new serial = re-registered); the
        engine loads it (off its thread, through the store's caches) when the request arrives.
        An on-demand name needs nothing: the store resolves it under its source on a cold load."""
        if not spec.on_demand and self.specs.get(spec.name) != spec:
            await self.store.register(spec.name, spec.path)
            self.specs[spec.name] = spec

    async def _sync(self, epoch: int) -> None:
        """Drop adapters unregistered since the last sync (cheap: only when the epoch moved)."""
        if epoch <= self.epoch:
            return
        specs, latest = await self.registry.list.remote()
        for name in set(self.specs) - {s.name for s in specs}:
            del self.specs[name]
            with suppress(AdapterNotFoundError):
                await self.store.unregister(name)
        self.epoch = max(self.epoch, latest)

    def __del__(self):
        if hasattr(self, "metrics"):  # absent when __init__ raised: nothing was started
            self.metrics.stop()
        if hasattr(self, "engine"):
            self.engine.shutdown()
