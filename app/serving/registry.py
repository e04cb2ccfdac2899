"""The app's adapter registry: one small deployment every ingress and replica reads.

Registration must reach every LoraReplica, including replicas started later by
autoscaling. Rather than broadcast, the registry is the single source of truth:
the ingress resolves each request's adapter from it and sends its AdapterSpec
(name, path, serial) along, so any replica can register it on demand (the
engine's AdapterStore then loads it and tracks its content version); each change
bumps an epoch, and a replica that sees a newer epoch re-reads the list and
drops the adapters that were unregistered. With `registry_path` set (a local file
or an s3:// object, app/serving/registry_store.py), every change is written there before it
is acknowledged and a (re)started registry starts from `adapter_dirs` with the saved
changes on top: names registered at run time come back, unregistered ones stay gone.
Without it, runtime registrations live in this actor's memory only.

Each Ingress resolves names from its own copy, kept current by long-polling `changes`
(app/serving/registry_feed.py); the admin routes `settle` a change into every copy before
they answer, so no request waits on this actor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from ray import serve

from adapters_store.paths import NAME
from app.errors import RegistryUnavailableError
from app.serving.registry_feed import LEASE_S, POLL_S, ChangeFeed, Changes
from app.serving.registry_store import FORMAT, open_store


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str  # a local PEFT directory (or an s3:// URI the AdapterStore reads)
    serial: int  # the registry epoch of its registration: registering a name again is a new spec
    version: str | None = None  # the content version the validating load resolved
    on_demand: bool = False  # not registered: the replicas' stores resolve it under adapter_source


def resolve(specs: dict[str, AdapterSpec], source: str | None, name: str) -> AdapterSpec | None:
    """A registered name's spec; else, with an adapter_source, an on-demand spec (no I/O here:
    the replica's store looks it up once and remembers a missing name for miss_ttl_s)."""
    spec = specs.get(name)
    if spec is None and source is not None and NAME.match(name):
        spec = AdapterSpec(name, source.rstrip("/") + "/" + name, 0, on_demand=True)
    return spec


def scan(dirs) -> list[AdapterSpec]:
    """Every PEFT directory directly under each of dirs (a later dir wins a name clash)."""
    from adapters_store.sources import LocalSource, local_adapters  # here: the registry actor need not import torch

    found: dict[str, str] = {}
    for d in dirs:
        found.update(local_adapters(Path(d)))
    return [
        AdapterSpec(name, path, 0, LocalSource(Path(path)).snapshot().version) for name, path in sorted(found.items())
    ]


# On the head node, beside the proxy and (in the shipped configs) the Ingress: losing a worker never
# restarts it (its state is in memory unless registry_path is set). Each Ingress replica keeps
# one long-poll open here, and a shutdown waits for none of them (a view just polls again).
@serve.deployment(
    name="AdapterRegistry",
    num_replicas=1,
    max_ongoing_requests=1000,
    graceful_shutdown_timeout_s=1.0,
    ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
)
class AdapterRegistry:
    def __init__(
        self,
        initial: list[AdapterSpec],
        location: str | None = None,
        source: str | None = None,
        lease_s: float = LEASE_S,
        clock=None,
    ):
        """location: registry_path (None: in memory only); source: adapter_source (None: registered
        names only); lease_s, clock: the views' lease and its clock (registry_feed.py; tests)."""
        self._source = source
        self._specs = {s.name: s for s in initial}
        self._scanned = set(self._specs)
        self._epoch = 0
        self._store = open_store(location)
        self._added: dict[str, dict] = {}  # runtime registrations, as saved
        self._removed: set[str] = set()  # names from adapter_dirs unregistered at run time
        saved = self._store.load() if self._store else None
        if saved:
            self._restore(saved)
        self.feed = ChangeFeed(self._epoch, lease_s, **({"clock": clock} if clock else {}))

    def _restore(self, saved: dict) -> None:
        self._epoch = int(saved.get("epoch", 0))
        self._removed = set(saved.get("removed", ()))
        self._added = dict(saved.get("adapters", {}))
        for name in self._removed:
            self._specs.pop(name, None)
        for name, entry in self._added.items():
            self._specs[name] = AdapterSpec(name, entry["path"], self._epoch, entry.get("version"))

    def _commit(self, added: dict[str, dict], removed: set[str]) -> None:
        """Save the next state, then adopt it: a failed save changes nothing."""
        if self._store is not None:
            state = {"format": FORMAT, "epoch": self._epoch + 1, "adapters": added, "removed": sorted(removed)}
            try:
                self._store.save(state)
            except Exception as exc:
                raise RegistryUnavailableError(
                    f"the adapter registry could not be saved: {type(exc).__name__}"
                ) from None
        self._epoch += 1
        self._added, self._removed = added, removed

    def lookup(self, name: str) -> tuple[AdapterSpec | None, int]:
        with self.feed.lock:
            return resolve(self._specs, self._source, name), self._epoch

    def list(self) -> tuple[list[AdapterSpec], int]:
        with self.feed.lock:
            return sorted(self._specs.values(), key=lambda s: s.name), self._epoch

    def put(self, name: str, path: str, version: str | None = None) -> AdapterSpec:
        with self.feed.lock:
            self._commit({**self._added, name: {"path": path, "version": version}}, self._removed - {name})
            spec = self._specs[name] = AdapterSpec(name, path, self._epoch, version)
            self.feed.record(self._epoch, name, spec)
            return spec

    def remove(self, name: str) -> bool:
        with self.feed.lock:
            if name not in self._specs:
                return False
            removed = self._removed | {name} if name in self._scanned else self._removed
            self._commit({k: v for k, v in self._added.items() if k != name}, removed)
            del self._specs[name]
            self.feed.record(self._epoch, name, None)
            return True

    # -- the Ingresses' copies (registry_feed.py) ------------------------------------------
    async def changes(self, view: str, incarnation: str | None, since: int, wait_s: float = POLL_S) -> Changes:
        """What ``view`` lacks after ``since`` (its acknowledgement of it), as soon as there is
        any, else an empty answer after ``wait_s`` (at most a third of the lease)."""
        self.feed.ack(view, incarnation, since)
        deadline = asyncio.get_running_loop().time() + min(wait_s, self.feed.lease_s / 3)
        while True:
            with self.feed.lock:
                if incarnation != self.feed.incarnation or since > self._epoch:  # restarted, or unknown
                    return self._changes(table=tuple(self._specs.values()))
                delta = self.feed.since(since)
                if delta is None:
                    return self._changes(table=tuple(self._specs.values()))
                if delta or asyncio.get_running_loop().time() >= deadline:
                    return self._changes(changes=delta)
            await self.feed.wait(deadline - asyncio.get_running_loop().time())

    async def settle(self, epoch: int | None = None) -> int:
        """Wait until every live view holds ``epoch`` (None: the current one); how many views
        stopped counting meanwhile (past their lease) rather than acknowledging it."""
        target = self._epoch if epoch is None else epoch
        pending = self.feed.pending(target)
        waited = set(pending)
        while pending:
            await self.feed.wait(self.feed.expiry(pending))
            pending = self.feed.pending(target)
        return sum(not self.feed.holds(v, target) for v in waited)

    def _changes(self, **what) -> Changes:
        return Changes(self.feed.incarnation, self._epoch, self._source, self.feed.lease_s, **what)
