"""How the adapter registry's changes reach every Ingress, and how a change waits for them.

Each Ingress keeps a local copy of the registry (app/openai/adapter_view.py) and long-polls
``changes(view, incarnation, since)``: the call answers at once when the registry's epoch is
past ``since`` (with the changes since then, or the whole table when those are no longer
logged or the registry restarted), else when the epoch moves or after ``wait_s``. Each call
is also the view's acknowledgement: a view asking from ``since`` holds everything up to it.

``settle(epoch)`` waits until every live view has acknowledged ``epoch``: the admin routes
call it after a change, so the change is in every Ingress's copy before they answer. A view
is live while it polls; one that has not polled for ``lease_s`` (its Ingress died, or is cut
off) stops counting, and that view, by its own clock, stops answering adapter requests from
its copy at the same point (it measures from when it sent its last answered poll, which is
no later than when the registry saw it), so no Ingress serves a change it did not see.

The registry's synchronous methods run on Serve's thread pool and its async ones on the
replica's event loop: the state is guarded by a lock and waiters are woken on their loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

POLL_S = 5.0  # a long-poll's longest wait: each view renews its lease at least this often
LEASE_S = 15.0  # a view that has not polled for this long is not waited for (and serves no adapters)
LOGGED_CHANGES = 1024  # changes kept for deltas; a view further behind gets the whole table


@dataclass(frozen=True)
class Changes:
    """What a view applies: ``table`` (every spec, replacing its copy) or ``changes`` ((name,
    spec or None = removed), in order), the registry's ``epoch``, and what resolving needs."""

    incarnation: str
    epoch: int
    source: str | None  # adapter_source: names not registered resolve on demand under it
    lease_s: float
    table: tuple | None = None
    changes: tuple = ()


class ChangeFeed:
    """The registry's change log, its views' acknowledgements, and the wake-ups between them."""

    def __init__(self, epoch: int, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic):
        self.incarnation = uuid.uuid4().hex  # a restarted registry is a new one: views reload whole
        self.lease_s, self._clock = lease_s, clock
        self.lock = threading.Lock()
        self._first = epoch  # the log holds the changes after this epoch
        self._log: deque[tuple[int, str, object]] = deque(maxlen=LOGGED_CHANGES)
        self._acks: dict[str, tuple[int, float]] = {}  # view → (epoch it holds, when it last polled)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pulse: asyncio.Event | None = None

    def record(self, epoch: int, name: str, spec) -> None:
        """Under ``lock``: ``name`` became ``spec`` (None: removed) at ``epoch``."""
        if len(self._log) == self._log.maxlen:
            self._first = self._log[0][0]
        self._log.append((epoch, name, spec))
        self._wake()

    def since(self, epoch: int) -> tuple | None:
        """Under ``lock``: the (name, spec) changes after ``epoch``, or None if not all logged."""
        if epoch < self._first:
            return None
        return tuple((name, spec) for e, name, spec in self._log if e > epoch)

    def ack(self, view: str, incarnation: str | None, since: int) -> None:
        held = since if incarnation == self.incarnation else -1
        with self.lock:
            self._acks[view] = (held, self._clock())
        self._wake()

    def pending(self, epoch: int) -> list[str]:
        """Live views that have not acknowledged ``epoch`` (views past their lease are dropped)."""
        now = self._clock()
        with self.lock:
            for view in [v for v, (_, seen) in self._acks.items() if now - seen >= self.lease_s]:
                del self._acks[view]
            return [v for v, (held, _) in self._acks.items() if held < epoch]

    def holds(self, view: str, epoch: int) -> bool:
        with self.lock:
            held = self._acks.get(view)
        return held is not None and held[0] >= epoch

    def expiry(self, views: list[str]) -> float:
        """Seconds until the first of ``views`` would pass its lease."""
        now = self._clock()
        with self.lock:
            seen = [self._acks[v][1] for v in views if v in self._acks]
        return max(0.0, min(seen, default=now) + self.lease_s - now)

    async def wait(self, timeout: float) -> None:
        """Until the next change or acknowledgement, or ``timeout`` seconds."""
        event = self._event()
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake-up
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
        except TimeoutError:
            pass

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first waiter (or a test's new loop) owns the wake-ups
            self._loop, self._pulse = loop, asyncio.Event()
        return self._pulse

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        """On the loop: wake every current waiter; later waiters wait for the next pulse."""
        if self._pulse is not None:
            self._pulse.set()
            self._pulse = asyncio.Event()
