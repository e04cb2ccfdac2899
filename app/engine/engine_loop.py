"""The engine's busy loop: the one thread that touches its core (EngineCore, or any Core of
app/engine/interface.py).

Callers post adds, aborts and calls (Add, Abort, Call) to an inbox; the loop drains it, steps the core and
delivers each step's chunks. How delivered chunks leave the loop is the subclass's:
AsyncEngine hands them to asyncio event loops in the same process
(app/engine/async_engine.py); the engine process sends them to its replica in one message
per step (app/engine/core_process.py). Each step and each delivered token is recorded in
``telemetry`` (app/engine/telemetry.py).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from app.engine.engine_stats import EngineReport
from app.engine.interface import Core
from app.engine.telemetry import EngineTelemetry
from app.protocol import Chunk, ErrorChunk, GenerateRequest, Migrate, is_final

log = logging.getLogger(__name__)


class StreamState:
    """What the loop keeps of one request it runs."""

    def __init__(self, request: GenerateRequest, arrival: float | None = None):
        self.request = request
        self.arrival = time.monotonic() if arrival is None else arrival  # CLOCK_MONOTONIC: one clock per host
        self.last_token: float | None = None  # when its previous token was delivered
        self.unfinished = set(range(request.index, request.index + request.n))  # choices not ended


# -- the inbox's messages (any thread → the loop) ------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    stream: StreamState
    adapter: object = None  # its LoraWeights, resolved off the loop (None: the base model, or resolve here)
    grammar: object = None  # its compiled guide (Grammars.compile), likewise


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    fn: Callable  # fn(core, *args) → done's result
    args: tuple
    done: Future


Message = Add | Abort | Call


def report(core: Core) -> EngineReport:
    """The engine's counters and adapters (a call run on the loop: exact, not a stale snapshot)."""
    return core.report()


class EngineLoop(abc.ABC):
    def __init__(self, core: Core):
        """A preempted request is re-queued by the core's scheduler when the core was built with
        EngineConfig.requeue_preempted, else its stream ends with a Migrate for the caller to re-route."""
        self.core = core
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._streams: dict[str, StreamState] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.snapshot = core.stats()
        self.telemetry = EngineTelemetry()

    # -- what subclasses provide --------------------------------------------------------
    @abc.abstractmethod
    def _emit(self, stream: StreamState, chunk: Chunk) -> None:
        """A chunk for ``stream``, to go out with this step's others."""

    @abc.abstractmethod
    def _send(self) -> None:
        """Everything emitted since the last send leaves the loop (once per step)."""

    @abc.abstractmethod
    def _accepted(self, stream: StreamState, error: Exception | None) -> None:
        """The add of ``stream`` was taken (error None) or refused."""

    # -- any thread ---------------------------------------------------------------------------
    def post(self, message: Message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # -- the loop's thread --------------------------------------------------------------------
    def run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.core.has_work():
                self._send()  # what the inbox produced (an abort's chunk, a drain's Migrates) goes now
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
            if self.core.last_preempted:
                self.telemetry.preempted(self.core.last_preempted)
            self.snapshot = self.core.stats()
            for chunk in chunks:
                self._deliver(chunk)
            self._send()
            if self.core.idle:
                time.sleep(0.0005)  # waiting on adapter copies: poll, don't spin

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case Add():
                    self._add(message)
                case Abort(request_id):
                    for chunk in self.core.abort(request_id):
                        self._deliver(chunk)
                case Call(fn, args, done):
                    self._call(fn, args, done)

    def _add(self, add: Add) -> None:
        stream = add.stream
        try:
            self.core.add(stream.request, adapter=add.adapter, grammar=add.grammar)
        except Exception as exc:
            self._accepted(stream, exc)
            return
        self._streams[stream.request.request_id] = stream
        if not stream.request.resume_token_ids:  # a migrated-in request was counted where it arrived
            self.telemetry.request(stream.request.adapter, len(stream.request.prompt_token_ids))
        self._accepted(stream, None)

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
        if is_final(chunk):
            stream.unfinished.discard(chunk.index)
            if not stream.unfinished:
                del self._streams[chunk.request_id]
        self._emit(stream, chunk)

    def _record(self, stream: StreamState, chunk: Chunk) -> None:
        t = self.telemetry
        if isinstance(chunk, Migrate):  # it leaves this engine unfinished (a preemption is counted by the step)
            t.migrated(chunk.reason)
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

    def evict_all(self, reason: str = "draining") -> int:
        """On the loop (through a call): end every request's stream with Migrate(reason); how many."""
        migrates = self.core.evict_all(reason)
        for chunk in migrates:
            self._deliver(chunk)
        return len(migrates)

    def _fail_all(self, exc: Exception) -> list[Chunk]:
        failed = []
        for request_id, stream in list(self._streams.items()):
            self.core.abort(request_id)
            failed += [ErrorChunk(request_id, f"engine failure: {exc}", 500, i) for i in sorted(stream.unfinished)]
        return failed
