"""The engine on a thread of this process, streaming chunks to asyncio callers.

Only the engine thread touches EngineCore (app/engine/engine_loop.py). A step's chunks go
to each event loop in one hand-over (one thread-safe wake-up per step, not per chunk); each
request's stream then yields everything that accumulated since its previous item as one
item (consecutive TokenChunks merged), so a stream whose reader keeps up gets one token per
item and a slow reader gets many, with no timer holding any token back. The engine process
(app/engine/process_engine.py) offers the same interface with the loop in a child process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

from app.engine.engine_loop import Abort, Add, Call, EngineLoop, StreamState, report
from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.interface import Core
from app.engine.telemetry import TelemetryBatch
from app.protocol import Chunk, GenerateRequest, coalesce, is_final

log = logging.getLogger(__name__)


class _Stream(StreamState):
    def __init__(self, request: GenerateRequest, loop: asyncio.AbstractEventLoop, arrival: float | None = None):
        super().__init__(request, arrival)
        self.loop = loop
        self.pending: list[Chunk] = []  # delivered, not yet yielded (touched on the loop only)
        self.ready = asyncio.Event()
        self.accepted: Future = Future()

    async def items(self) -> list[Chunk]:
        """Everything delivered since the last call (at least one chunk), coalesced."""
        await self.ready.wait()
        self.ready.clear()
        chunks, self.pending = self.pending, []
        return coalesce(chunks)


def hand_over(deliveries: list[tuple[_Stream, Chunk]]) -> None:
    """On the event loop: one step's chunks for the streams of this loop."""
    for stream, chunk in deliveries:
        stream.pending.append(chunk)
        stream.ready.set()


def send_to_loops(outbox: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Chunk]]]) -> None:
    """Hand what one step delivered to each event loop: one wake-up per loop."""
    for loop, deliveries in outbox.items():
        try:
            loop.call_soon_threadsafe(hand_over, deliveries)
        except RuntimeError:  # that loop is closed: nobody reads its streams any more
            log.warning("dropped %d chunks for a closed event loop", len(deliveries))
    outbox.clear()


def settle(accepted: Future, error: BaseException | None) -> None:
    """Answer an add; its caller may have left meanwhile (cancelling the Future: its finally aborts the request)."""
    try:
        accepted.set_result(None) if error is None else accepted.set_exception(error)
    except InvalidStateError:
        pass


class Callers:
    """generate() calls in progress, for the autoscaler's idle time."""

    def __init__(self):
        self.n = 0
        self.idle_since: float | None = time.time()  # wall time the last caller left; None while busy

    def enter(self) -> None:
        self.n += 1
        self.idle_since = None

    def leave(self) -> None:
        self.n -= 1
        if not self.n:
            self.idle_since = time.time()


async def relay(stream: _Stream) -> AsyncIterator[Chunk]:
    """A stream's items until each of its choices has ended."""
    unfinished = set(range(stream.request.index, stream.request.index + stream.request.n))  # this loop's own copy
    while True:
        for item in await stream.items():
            yield item
            if is_final(item):
                unfinished.discard(item.index)
            if not unfinished:
                return


class LocalAdapters:
    """The engine's AdapterStore as the replica uses it (thread-safe; loads on the store's threads)."""

    def __init__(self, store):
        self.store = store

    async def register(self, name: str, uri: str) -> None:
        self.store.register(name, uri)

    async def unregister(self, name: str) -> None:
        self.store.unregister(name)

    async def load(self, name: str) -> None:
        await self.store.aget(name)

    async def version(self, name: str) -> str | None:
        return self.store.version(name)


class AsyncEngine(EngineLoop):
    def __init__(self, core: Core):
        super().__init__(core)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Chunk]]] = defaultdict(list)
        self._callers = Callers()
        self.store = LocalAdapters(core.adapters)
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._thread.start()
        threading.Thread(target=core.grammars.warm, name="grammar-vocab", daemon=True).start()

    @property
    def idle_since(self) -> float | None:
        return self._callers.idle_since

    # -- caller side (any thread with an event loop) -----------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Chunks of one request until each of its choices finishes, errors or migrates. Validation
        errors raise here before the first chunk; leaving the iterator early aborts the request."""
        stream = _Stream(request, asyncio.get_running_loop())
        self._callers.enter()
        finished = False
        try:
            # S3 / disk / parse happen here, on the store's threads, never on the engine thread
            adapter = await self.core.adapters.aget(request.adapter) if request.adapter else None
            grammar = None  # likewise a guide's compile (cached; a bad one raises here, before any chunk)
            if request.params.guide is not None:
                grammar = await asyncio.to_thread(self.core.grammars.compile, request.params.guide)
            self.post(Add(stream, adapter, grammar))
            await asyncio.wrap_future(stream.accepted)
            async for item in relay(stream):
                yield item
            finished = True
        finally:
            if not finished:
                self.abort(request.request_id)
            self._callers.leave()

    def abort(self, request_id: str) -> None:
        self.post(Abort(request_id))

    def drain(self) -> Future:
        """End every request's stream with Migrate(reason="draining"); a Future of how many."""
        return self.call(lambda core: self.evict_all("draining"))

    def call(self, fn, *args) -> Future:
        """Run fn(core, *args) on the engine thread (e.g. to register an adapter); a Future."""
        done: Future = Future()
        self.post(Call(fn, args, done))
        return done

    def stats(self) -> Future[EngineReport]:
        """A Future of the engine's counters and adapters, read on the engine thread."""
        return self.call(report)

    def metrics_sample(self) -> tuple[EngineStats, TelemetryBatch]:
        """(the stats of the latest step, the telemetry recorded since the previous sample)."""
        return self.snapshot, self.telemetry.drain()

    def failure(self) -> str | None:
        """Why this engine can serve nothing more (None: it can)."""
        return self.core.failure()

    def shutdown(self) -> None:
        self.stop()
        self._thread.join(timeout=10)

    # -- engine thread --------------------------------------------------------------
    def _accepted(self, stream: _Stream, error: Exception | None) -> None:
        settle(stream.accepted, error)

    def _emit(self, stream: _Stream, chunk: Chunk) -> None:
        self._outbox[stream.loop].append((stream, chunk))

    def _send(self) -> None:
        send_to_loops(self._outbox)


def build_async_engine(settings) -> AsyncEngine:
    """The replica's engine from its settings (app/serving/replica.ReplicaSettings: model,
    its core's engine config, start-up adapters, adapter store config)."""
    from app.engine.factory import build_engine

    adapters = {s.name: s.path for s in settings.adapters}
    return AsyncEngine(build_engine(settings.model, settings.core_config, adapters, store_config=settings.store))
