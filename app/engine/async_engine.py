"""The engine on its own thread, streaming chunks to asyncio callers.

Only the engine thread touches EngineCore: callers post adds and aborts to an
inbox. A step's chunks go to each event loop in one hand-over (one thread-safe
wake-up per step, not per chunk); each request's stream then yields everything that
accumulated since its previous item as one item (consecutive TokenChunks merged), so
a stream whose reader keeps up gets one token per item and a slow reader gets many,
with no timer holding any token back. Each step and each delivered token is recorded
in ``telemetry`` (app/engine/telemetry.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from concurrent.futures import Future

from app.engine.core import EngineCore
from app.engine.telemetry import EngineTelemetry
from app.protocol import Chunk, ErrorChunk, GenerateRequest, Migrate, coalesce, is_final

log = logging.getLogger(__name__)


class _Stream:
    def __init__(self, request: GenerateRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.pending: list[Chunk] = []  # delivered, not yet yielded (touched on the loop only)
        self.ready = asyncio.Event()
        self.arrival = time.monotonic()
        self.last_token: float | None = None  # when its previous token was delivered
        self.unfinished = set(range(request.index, request.index + request.n))  # choices not ended (engine thread)

    async def items(self) -> list[Chunk]:
        """Everything delivered since the last call (at least one chunk), coalesced."""
        await self.ready.wait()
        self.ready.clear()
        chunks, self.pending = self.pending, []
        return coalesce(chunks)


def _hand_over(deliveries: list[tuple[_Stream, Chunk]]) -> None:
    """On the event loop: one step's chunks for the streams of this loop."""
    for stream, chunk in deliveries:
        stream.pending.append(chunk)
        stream.ready.set()


class AsyncEngine:
    def __init__(self, core: EngineCore, migrate_locally: bool = True):
        """migrate_locally: a preempted request is re-queued here (front of the queue)
        instead of ending its stream with a Migrate chunk for the caller to re-route."""
        self.core = core
        self.migrate_locally = migrate_locally
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Chunk]]] = defaultdict(list)
        self._wake = threading.Event()
        self._stopped = False
        self.snapshot = core.stats()
        self.telemetry = EngineTelemetry()
        self._callers = 0  # generate() calls in progress (adapter loads included)
        self.idle_since: float | None = time.time()  # wall time the last caller left; None while busy
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        threading.Thread(target=core.grammars.warm, name="grammar-vocab", daemon=True).start()

    # -- caller side (any thread with an event loop) -----------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Chunks of one request until each of its choices finishes, errors or migrates. Validation
        errors raise here before the first chunk; leaving the iterator early aborts the request."""
        stream = _Stream(request, asyncio.get_running_loop())
        self._callers += 1
        self.idle_since = None
        finished = False
        unfinished = set(stream.unfinished)  # this loop's own copy
        try:
            # S3 / disk / parse happen here, on the store's threads, never on the engine thread
            adapter = await self.core.adapters.aget(request.adapter) if request.adapter else None
            grammar = None  # likewise a guide's compile (cached; a bad one raises here, before any chunk)
            if request.params.guide is not None:
                grammar = await asyncio.to_thread(self.core.grammars.compile, request.params.guide)
            accepted: Future = Future()
            self._post(("add", stream, accepted, adapter, grammar))
            await asyncio.wrap_future(accepted)
            while True:
                for item in await stream.items():
                    yield item
                    if is_final(item):
                        unfinished.discard(item.index)
                    if not unfinished:
                        finished = True
                        return
        finally:
            if not finished:
                self.abort(request.request_id)
            self._callers -= 1
            if not self._callers:
                self.idle_since = time.time()

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def drain(self) -> Future:
        """End every request's stream with Migrate(reason="draining"); a Future of how many."""
        return self.call(lambda core: self._evict_all(core.evict_all("draining")))

    def call(self, fn, *args):
        """Run fn(core, *args) on the engine thread (e.g. to register an adapter); a Future."""
        done: Future = Future()
        self._post(("call", fn, args, done))
        return done

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    # -- engine thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._send()
            if not self.core.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                chunks = self.core.step()
            except Exception as exc:  # a failed step must not strand any stream
                log.exception("engine step failed")
                chunks = self._fail_all(exc)
            if not self.core.idle:
                self.telemetry.step(self.core.last_batch_size, time.perf_counter() - start)
            self.snapshot = self.core.stats()
            for chunk in chunks:
                self._deliver(chunk)
            self._send()
            if self.core.idle:
                time.sleep(0.0005)  # waiting on adapter copies: poll, don't spin

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._add(*item[1:])
            elif item[0] == "abort":
                for chunk in self.core.abort(item[1]):
                    self._deliver(chunk)
            else:
                self._call(*item[1:])

    def _add(self, stream: _Stream, accepted: Future, adapter, grammar) -> None:
        try:
            self.core.add(stream.request, adapter=adapter, grammar=grammar)
        except Exception as exc:
            accepted.set_exception(exc)
            return
        self._streams[stream.request.request_id] = stream
        if not stream.request.resume_token_ids:  # a migrated-in request was counted where it arrived
            self.telemetry.request(stream.request.adapter, len(stream.request.prompt_token_ids))
        accepted.set_result(None)

    def _call(self, fn, args, done: Future) -> None:
        try:
            done.set_result(fn(self.core, *args))
        except Exception as exc:
            done.set_exception(exc)

    def _deliver(self, chunk: Chunk) -> None:
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            return
        self._record(stream, chunk)
        if isinstance(chunk, Migrate) and self.migrate_locally and chunk.reason != "draining":
            self.core.add(stream.request.resumed(chunk), front=True)  # that choice alone, with its seed
            return
        if is_final(chunk):
            stream.unfinished.discard(chunk.index)
            if not stream.unfinished:
                del self._streams[chunk.request_id]
        if isinstance(chunk, Migrate):  # it leaves this engine unfinished
            self.telemetry.migrated(chunk.reason)
        self._outbox[stream.loop].append((stream, chunk))

    def _send(self) -> None:
        """Hand what this step delivered to each event loop: one wake-up per loop."""
        for loop, deliveries in self._outbox.items():
            try:
                loop.call_soon_threadsafe(_hand_over, deliveries)
            except RuntimeError:  # that loop is closed: nobody reads its streams any more
                log.warning("dropped %d chunks for a closed event loop", len(deliveries))
        self._outbox.clear()

    def _record(self, stream: _Stream, chunk: Chunk) -> None:
        t = self.telemetry
        if isinstance(chunk, Migrate):
            if chunk.reason == "kv_cache_exhausted":
                t.preempted()
        elif isinstance(chunk, ErrorChunk):
            t.finished("error")
        else:
            now = time.monotonic()
            if chunk.token_ids:
                first = stream.last_token is None
                t.tokens(
                    len(chunk.token_ids),
                    ttft=now - stream.arrival if first and not stream.request.resume_token_ids else None,
                    gap=None if first else now - stream.last_token,
                )
                stream.last_token = now
            if chunk.finish_reason is not None:
                t.finished(chunk.finish_reason)

    def _evict_all(self, migrates: list[Migrate]) -> int:
        for chunk in migrates:
            self._deliver(chunk)
        return len(migrates)

    def _fail_all(self, exc: Exception) -> list[Chunk]:
        failed = []
        for request_id, stream in list(self._streams.items()):
            self.core.abort(request_id)
            failed += [ErrorChunk(request_id, f"engine failure: {exc}", 500, i) for i in sorted(stream.unfinished)]
        return failed
