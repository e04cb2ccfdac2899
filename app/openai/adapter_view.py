"""The Ingress's own copy of the adapter registry: a request resolves its adapter name here,
without a call to another actor.

A background task long-polls the registry (``AdapterRegistry.changes``,
app/serving/registry_feed.py) and applies what it answers: the whole table, or the changes
since the epoch this copy holds. Requests read the copy as it is (one event loop: a change
applies between two requests, never during one). The admin routes make a change visible
everywhere before they answer: ``settle`` waits until every live copy holds the change's
epoch (each copy acknowledges an epoch by polling from it).

While the registry is slow or unreachable, names resolve from the copy. A copy that has not
heard from the registry for the registry's lease may be missing a change that the registry no
longer waited for it to see, so from then on it answers adapter requests with a 503 until it
hears again (the base model is not resolved here and keeps working).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from app.errors import RegistryUnavailableError
from app.serving.registry import AdapterSpec, resolve
from app.serving.registry_feed import POLL_S, Changes

log = logging.getLogger("ray.serve")

_RETRY_S = (0.05, 1.0)  # the first and the longest pause between failed polls


class AdapterView:
    def __init__(self, registry, poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic):
        """registry: a handle to AdapterRegistry (its methods called as ``.remote(...)``)."""
        self.id = uuid.uuid4().hex
        self._registry, self._poll_s, self._clock = registry, poll_s, clock
        self._specs: dict[str, AdapterSpec] = {}
        self.epoch = -1  # none held yet
        self._incarnation: str | None = None
        self._source: str | None = None
        self._lease_s = 0.0
        self._contact: float | None = None  # when the last answered poll was sent (this clock)
        self._heard: asyncio.Event | None = None  # set (and replaced) on every answered poll
        self._task: asyncio.Task | None = None

    # -- requests ----------------------------------------------------------------------
    async def resolve(self, name: str) -> tuple[AdapterSpec | None, int]:
        """(spec or None, the epoch it is from); no await unless this copy is not current."""
        if not self.current():
            await self._hear(f"The adapter registry has not answered; `{name}` cannot be resolved now.")
        return resolve(self._specs, self._source, name), self.epoch

    async def specs(self) -> list[AdapterSpec]:
        if not self.current():
            await self._hear("The adapter registry has not answered; the adapters cannot be listed now.")
        return sorted(self._specs.values(), key=lambda s: s.name)

    def current(self) -> bool:
        """Heard from the registry within its lease: the registry still waits for this copy."""
        return self._contact is not None and self._clock() - self._contact < self._lease_s

    async def _hear(self, refusal: str) -> None:
        """Wait for the next answered poll (at most a lease's worth); else RegistryUnavailableError."""
        self.start()
        try:
            async with asyncio.timeout(max(self._lease_s, 3 * self._poll_s)):
                await self._heard_event().wait()
        except TimeoutError:
            raise RegistryUnavailableError(refusal) from None

    # -- admin -------------------------------------------------------------------------
    async def settle(self, epoch: int | None = None) -> None:
        """Until every live copy (this one included) holds ``epoch`` (None: the registry's current one)."""
        lapsed = await self._registry.settle.remote(epoch)
        if lapsed:
            log.warning(
                "%d Ingress copies of the adapter registry stopped polling before the change reached them", lapsed
            )

    # -- the poll ------------------------------------------------------------------------
    def start(self) -> None:
        """Begin polling on the running loop (idempotent). Without one (constructed off a loop),
        the first request starts it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._poll())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _poll(self) -> None:
        pause = _RETRY_S[0]
        while True:
            sent = self._clock()
            try:
                changes = await self._registry.changes.remote(self.id, self._incarnation, self.epoch, self._poll_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # restarting, unreachable: keep serving the copy while it is current
                log.warning("adapter registry poll failed (%s); retrying in %.2f s", type(exc).__name__, pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, _RETRY_S[1])
                continue
            pause = _RETRY_S[0]
            self.apply(changes, sent)

    def apply(self, changes: Changes, sent: float) -> None:
        """Adopt a poll's answer; ``sent``: when its poll left (this clock)."""
        if changes.table is not None:
            self._specs = {s.name: s for s in changes.table}
        else:
            for name, spec in changes.changes:
                if spec is None:
                    self._specs.pop(name, None)
                else:
                    self._specs[name] = spec
        self._incarnation, self.epoch, self._source = changes.incarnation, changes.epoch, changes.source
        self._lease_s = changes.lease_s
        self._contact = sent
        heard, self._heard = self._heard_event(), None
        heard.set()

    def _heard_event(self) -> asyncio.Event:
        if self._heard is None:
            self._heard = asyncio.Event()
        return self._heard
