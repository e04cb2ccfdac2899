"""AsyncEngine's interface with the engine loop in a child process (app/engine/core_process.py).

This side only admits requests, relays outputs and answers calls: a reader thread takes each
step's message (every request's new chunks together), routes the chunks to their streams
and wakes each event loop once per step, as AsyncEngine's engine thread does in-process.
The child is started with multiprocessing's ``spawn`` (CUDA cannot be forked) from a keeper
thread that lives as long as the child, so the child's PR_SET_PDEATHSIG fires only when this
whole process dies. If the child dies, every open stream ends with an ErrorChunk, ``failure()``
says why, and ``on_death`` is called (the replica exits so that Serve replaces it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from app.engine import core_process
from app.engine import engine_wire as wire
from app.engine.async_engine import Callers, _Stream, relay, send_to_loops, settle
from app.engine.engine_loop import report
from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.telemetry import TelemetryBatch
from app.protocol import Chunk, ErrorChunk, GenerateRequest, is_final

log = logging.getLogger(__name__)

_SAMPLE_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine process is gone: this replica can serve nothing more."""


class ProcessEngine:
    def __init__(self, engine_factory: Callable, settings, on_death: Callable[[str], None] | None = None):
        """engine_factory(settings) → an AsyncEngine, called in the child (both are pickled by
        reference: module-level names). Returns once the engine is built; raises if it failed."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=core_process.main,
            args=(child, engine_factory, settings, os.getpid()),
            name="loraplex-engine",
            daemon=True,
        )
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._callers = Callers()
        self._dead: str | None = None
        self._stopping = False
        self.on_death = on_death
        self.store = RemoteAdapters(self)
        self._start(child)
        self.pid = self._process.pid
        threading.Thread(target=self._read, name="engine-outputs", daemon=True).start()

    def _start(self, child) -> None:
        started = threading.Event()

        def keep() -> None:  # the child's "parent" for PR_SET_PDEATHSIG is this thread: it outlives the child
            try:
                self._process.start()
            finally:
                started.set()
            self._process.join()

        threading.Thread(target=keep, name="engine-process", daemon=True).start()
        started.wait()
        child.close()
        while not self._conn.poll(1.0):  # building the model can take minutes: wait while it lives
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self._process.exitcode})")
        try:
            message = wire.loads(self._conn.recv_bytes())
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"the engine process exited during start-up (code {self._process.exitcode})") from None
        if isinstance(message, wire.Failed):
            self._process.join(10)
            raise RuntimeError(f"the engine failed to start in its process:\n{message.traceback}")

    @property
    def idle_since(self) -> float | None:
        return self._callers.idle_since

    # -- caller side (the replica's event loop) -------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """AsyncEngine.generate's contract: validation errors (and an adapter's load error)
        raise before the first chunk; leaving the iterator early aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        stream = _Stream(request, asyncio.get_running_loop())
        self._callers.enter()
        finished = False
        self._streams[request.request_id] = stream
        try:
            self._send(wire.Submit(request, stream.arrival))
            await asyncio.wrap_future(stream.accepted)
            async for item in relay(stream):
                yield item
            finished = True
        finally:
            if self._streams.get(request.request_id) is stream:
                del self._streams[request.request_id]
            accepted = stream.accepted
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not finished and not refused:  # taken, or perhaps taken: end it there
                self.abort(request.request_id)
            self._callers.leave()

    def abort(self, request_id: str) -> None:
        try:
            self._send(wire.Cancel(request_id))
        except (OSError, EngineDeadError):  # nothing runs there any more
            pass

    def drain(self) -> Future:
        """End every request's stream with Migrate(reason="draining"); a Future of how many."""
        return self._call(wire.Drain)

    def call(self, fn, *args) -> Future:
        """fn(core, *args) on the engine loop, in the child (fn pickled by reference); a Future."""
        return self._call(wire.RunCall, fn, args)

    def stats(self) -> Future[EngineReport]:
        return self.call(report)

    def metrics_sample(self) -> tuple[EngineStats, TelemetryBatch]:
        """(the latest step's stats, the telemetry recorded since the previous sample), from the child."""
        return self._call(wire.Sample).result(_SAMPLE_TIMEOUT_S)

    def failure(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._send(wire.Stop())
        except (OSError, EngineDeadError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)

    # -- plumbing ------------------------------------------------------------------------------
    def _call(self, kind: type, *payload) -> Future:
        """kind(call_id, *payload) to the child; a Future of its Reply."""
        done: Future = Future()
        call_id = next(self._ids)
        self._calls[call_id] = done
        try:
            self._send(kind(call_id, *payload))
        except (OSError, EngineDeadError) as exc:
            self._calls.pop(call_id, None)
            done.set_exception(EngineDeadError(self._dead or str(exc)))
        return done

    def _send(self, message: wire.ToEngine) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        data = wire.dumps(message)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _read(self) -> None:
        """The child's messages, in order, until its pipe closes."""
        while True:
            try:
                message: wire.FromEngine = wire.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                return self._died()
            match message:
                case wire.StepOut(accepts, chunks):
                    self._step(accepts, chunks)
                case wire.Reply(call_id, ok, value):
                    done = self._calls.pop(call_id, None)
                    if done is not None:
                        done.set_result(value) if ok else done.set_exception(wire.decode_error(value))

    def _step(self, accepts: list, chunks: list) -> None:
        for request_id, error in accepts:
            stream = self._streams.get(request_id)
            if stream is not None:
                settle(stream.accepted, None if error is None else wire.decode_error(error))
        outbox: dict = defaultdict(list)
        for t in chunks:
            chunk = wire.decode_chunk(t)
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                continue
            if is_final(chunk):
                stream.unfinished.discard(chunk.index)
                if not stream.unfinished:
                    del self._streams[chunk.request_id]
            outbox[stream.loop].append((stream, chunk))
        send_to_loops(outbox)

    def _died(self) -> None:
        self._process.join(10)
        self._dead = f"the engine process exited (code {self._process.exitcode})"
        if not self._stopping:
            log.error("%s: failing its %d streams", self._dead, len(self._streams))
            if self.on_death is not None:  # first: a replica exits here, and its streams fail over as a lost replica's
                self.on_death(self._dead)
        outbox: dict = defaultdict(list)
        for request_id, stream in list(self._streams.items()):
            if not stream.accepted.done():
                settle(stream.accepted, EngineDeadError(self._dead))
                continue
            for i in sorted(stream.unfinished):
                outbox[stream.loop].append((stream, ErrorChunk(request_id, self._dead, 503, i)))
        self._streams.clear()
        send_to_loops(outbox)
        for done in list(self._calls.values()):
            done.set_exception(EngineDeadError(self._dead))
        self._calls.clear()


class RemoteAdapters:
    """The engine's AdapterStore, in the child, as the replica uses it (LocalAdapters' methods)."""

    def __init__(self, engine: ProcessEngine):
        self.engine = engine

    async def register(self, name: str, uri: str) -> None:
        await asyncio.wrap_future(self.engine._call(wire.StoreCall, "register", (name, str(uri))))

    async def unregister(self, name: str) -> None:
        await asyncio.wrap_future(self.engine._call(wire.StoreCall, "unregister", (name,)))

    async def load(self, name: str) -> None:
        """Into the child's host memory (validated); the weights stay there."""
        await asyncio.wrap_future(self.engine._call(wire.StoreCall, "load", (name,)))

    async def version(self, name: str) -> str | None:
        return await asyncio.wrap_future(self.engine._call(wire.StoreCall, "version", (name,)))
