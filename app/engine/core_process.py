"""The engine process: the engine loop in a child of its replica, as vLLM V1's EngineCore runs
beside its API server.

The process's main thread runs the busy loop (schedule → step → sample → postprocess,
app/engine/engine_loop.py) and sends each step's chunks, all requests' together, as one
message. A reader thread takes the replica's messages; adds whose adapter is not in host
memory or whose guide needs compiling are prepared on the adapter store's loader threads
and a small compile pool, never on the loop. No asyncio, Serve or HTTP work runs here.

The process never outlives its replica: PR_SET_PDEATHSIG (Linux) kills it when the thread
that started it ends (the replica keeps that thread for the process's lifetime), a watch
thread exits when the parent pid changes, and the reader exits at the pipe's EOF.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

from adapters_store.errors import AdapterError
from app.engine import engine_wire as wire
from app.engine.engine_loop import Abort, Add, Call, EngineLoop, StreamState
from app.engine.interface import Core

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PARENT_POLL_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watch below still ends it
        pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(0)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)


class Sender:
    """One writer at a time on the pipe (the loop, the reader and loader callbacks all send)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: wire.FromEngine) -> None:
        data = wire.dumps(message)
        with self.lock:
            self.conn.send_bytes(data)

    def reply(self, call_id: int, done: Future) -> None:
        error = done.exception()
        if error is None:
            self.send(wire.Reply(call_id, True, done.result()))
        else:
            self.send(wire.Reply(call_id, False, wire.encode_error(error)))


class ProcessLoop(EngineLoop):
    """The loop whose output is one message per step on the pipe."""

    def __init__(self, core: Core, out: Sender):
        super().__init__(core)
        self.out = out
        self._chunks: list[tuple] = []
        self._accepts: list[tuple[str, bytes | None]] = []

    def _accepted(self, stream: StreamState, error: Exception | None) -> None:
        self._accepts.append((stream.request.request_id, None if error is None else wire.encode_error(error)))

    def _emit(self, stream: StreamState, chunk) -> None:
        self._chunks.append(wire.encode_chunk(chunk))

    def _send(self) -> None:
        if self._chunks or self._accepts:
            accepts, chunks, self._accepts, self._chunks = self._accepts, self._chunks, [], []
            self.out.send(wire.StepOut(accepts, chunks))


class Preparer:
    """An add's adapter weights (to host memory) and compiled guide, off the loop, then the add."""

    def __init__(self, loop: ProcessLoop, out: Sender):
        self.loop = loop
        self.out = out
        self.store = loop.core.adapters
        self.compiles = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._preparing: dict[str, int] = {}  # request id → adds of it being prepared
        self._aborted: set[str] = set()  # aborted while being prepared: their adds are dropped

    def add(self, stream: StreamState) -> None:
        name = stream.request.adapter
        if not name and stream.request.params.guide is None:
            return self.loop.post(Add(stream))
        with self._lock:
            rid = stream.request.request_id
            self._preparing[rid] = self._preparing.get(rid, 0) + 1
        if not name:
            return self._then_grammar(stream, None)
        self.store.prefetch(name).add_done_callback(lambda done: self._loaded(stream, name, done))

    def _loaded(self, stream: StreamState, name: str, done: Future) -> None:
        error = done.exception()
        if error is not None:
            _name(error, name)
            return self._reject(stream, error)
        self._then_grammar(stream, done.result())

    def _then_grammar(self, stream: StreamState, adapter) -> None:
        guide = stream.request.params.guide
        if guide is None:
            return self._post(stream, adapter, None)
        self.compiles.submit(self._compile, stream, adapter, guide)

    def _compile(self, stream: StreamState, adapter, guide) -> None:
        try:
            grammar = self.loop.core.grammars.compile(guide)
        except Exception as exc:
            return self._reject(stream, exc)
        self._post(stream, adapter, grammar)

    def abort(self, request_id: str) -> None:
        """In order with the adds before it: one still being prepared never reaches the loop."""
        with self._lock:
            if request_id in self._preparing:
                self._aborted.add(request_id)
        self.loop.post(Abort(request_id))

    def _prepared(self, stream: StreamState) -> bool:
        """Whether the add still goes ahead (it was not aborted meanwhile)."""
        rid = stream.request.request_id
        with self._lock:
            self._preparing[rid] -= 1
            aborted = rid in self._aborted
            if not self._preparing[rid]:
                del self._preparing[rid]
                self._aborted.discard(rid)
        return not aborted

    def _post(self, stream: StreamState, adapter, grammar) -> None:
        if self._prepared(stream):
            self.loop.post(Add(stream, adapter, grammar))

    def _reject(self, stream: StreamState, error: BaseException) -> None:
        if self._prepared(stream):
            self.out.send(wire.StepOut([(stream.request.request_id, wire.encode_error(error))], []))

    def store_call(self, call_id: int, method: wire.StoreMethod, args: tuple) -> None:
        """register / unregister / version run here, in order with the adds that follow;
        a load (``prefetch``) answers when the store's loader threads have it."""
        if method == "load":
            return self.add_load(call_id, args[0])
        run = {"register": self.store.register, "unregister": self.store.unregister, "version": self.store.version}
        done: Future = Future()
        try:
            done.set_result(run[method](*args))
        except Exception as exc:
            done.set_exception(exc)
        self.out.reply(call_id, done)

    def add_load(self, call_id: int, name: str) -> None:
        loading = self.store.prefetch(name)
        answer: Future = Future()

        def loaded(done: Future) -> None:
            error = done.exception()
            _name(error, name)
            answer.set_exception(error) if error is not None else answer.set_result(None)  # weights stay here
            self.out.reply(call_id, answer)

        loading.add_done_callback(loaded)


def _name(error: BaseException | None, adapter: str) -> None:
    """A load's failure names the adapter it was for, as AdapterStore.get's does."""
    if isinstance(error, AdapterError):
        error.adapter = adapter


def _read(conn, loop: ProcessLoop, out: Sender, prep: Preparer) -> None:
    while True:
        try:
            message = wire.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the replica is gone: so is its engine
            os._exit(0)
        match message:
            case wire.Submit(request, arrival):
                prep.add(StreamState(request, arrival))
            case wire.Cancel(request_id):
                prep.abort(request_id)
            case wire.RunCall(call_id, fn, args):
                _call_on_loop(loop, out, call_id, fn, args)
            case wire.Drain(call_id):
                _call_on_loop(loop, out, call_id, lambda core: loop.evict_all("draining"), ())
            case wire.StoreCall(call_id, method, args):
                prep.store_call(call_id, method, args)
            case wire.Sample(call_id):  # the metrics exporter's: the latest step's stats and the telemetry since
                out.send(wire.Reply(call_id, True, (loop.snapshot, loop.telemetry.drain())))
            case wire.Stop():
                loop.stop()
                return


def _call_on_loop(loop: ProcessLoop, out: Sender, call_id: int, fn, args: tuple) -> None:
    """fn(core, *args) on the loop; its Reply when it has run."""
    done: Future = Future()
    done.add_done_callback(lambda d: out.reply(call_id, d))
    loop.post(Call(fn, args, done))


def main(conn, engine_factory, settings, parent_pid: int) -> None:
    """The engine process's entry: engine_factory(settings) → an AsyncEngine, whose core then
    runs on this process's loop (its own thread is stopped)."""
    die_with_parent(parent_pid)
    # Its replica decides when it stops (wire.Stop) and dies with it: a terminal's Ctrl-C, sent to
    # the whole process group, would otherwise end it mid-step before the replica drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(levelname)s %(message)s")
    out = Sender(conn)
    try:
        engine = engine_factory(settings)
        engine.shutdown()
        loop = ProcessLoop(engine.core, out)
    except BaseException:
        out.send(wire.Failed(traceback.format_exc()))
        return
    threading.Thread(
        target=_read, args=(conn, loop, out, Preparer(loop, out)), name="engine-inbox", daemon=True
    ).start()
    out.send(wire.Ready())
    loop.run()
    # Stopped: every reply went out synchronously, and nothing here needs tearing down. The
    # interpreter's own teardown (torch's state) took 2-4 s on 2 CPU cores, all of it inside
    # Ctrl-C on `serve run` (issue 46: within 10 s), so skip it.
    os._exit(0)
