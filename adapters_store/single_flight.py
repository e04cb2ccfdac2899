"""At most one running call per key: concurrent callers share its outcome.

Each caller gets its own Future following the shared one, so a caller that
cancels (an aborted HTTP request) cancels only its wait, never the load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Executor, Future, InvalidStateError
from typing import TypeVar

T = TypeVar("T")


def _follow(shared: Future) -> Future:
    mine: Future = Future()

    def copy(done: Future) -> None:
        try:
            if done.cancelled():
                mine.cancel()
            elif done.exception() is not None:
                mine.set_exception(done.exception())
            else:
                mine.set_result(done.result())
        except (InvalidStateError, CancelledError):  # the caller cancelled its own wait meanwhile
            pass

    shared.add_done_callback(copy)
    return mine


class SingleFlight:
    def __init__(self, executor: Executor):
        self._executor = executor
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future] = {}

    def submit(self, key: Hashable, fn: Callable[[], T]) -> Future[T]:
        with self._lock:
            shared = self._running.get(key)
            if shared is None:
                shared = self._executor.submit(fn)
                self._running[key] = shared
                started = True
            else:
                started = False
        if started:  # outside the lock: the callback runs at once if fn already finished
            shared.add_done_callback(lambda done: self._finished(key, done))
        return _follow(shared)

    def _finished(self, key: Hashable, done: Future) -> None:
        with self._lock:
            if self._running.get(key) is done:
                del self._running[key]

    def running(self) -> int:
        return len(self._running)
