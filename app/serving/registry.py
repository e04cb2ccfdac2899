"""The app's adapter registry: one small deployment every ingress and replica reads.

Registration must reach every LoraReplica, including replicas started later by
autoscaling. Rather than broadcast, the registry is the single source of truth:
the ingress resolves each request's adapter here and sends its AdapterSpec
(name, path, serial) along, so any replica can register it on demand (the
engine's AdapterStore then loads it and tracks its content version); each change
bumps an epoch, and a replica that sees a newer epoch re-reads the list and
drops the adapters that were unregistered. With `registry_path` set (a local file
or an s3:// object, app/serving/registry_store.py), every change is written there before it
is acknowledged and a (re)started registry starts from `adapter_dirs` with the saved
changes on top: names registered at run time come back, unregistered ones stay gone.
Without it, runtime registrations live in this actor's memory only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ray import serve

from adapters_store.paths import NAME
from app.errors import RegistryUnavailableError
from app.serving.registry_store import FORMAT, open_store


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str  # a local PEFT directory (or an s3:// URI the AdapterStore reads)
    serial: int  # the registry epoch of its registration: registering a name again is a new spec
    version: str | None = None  # the content version the validating load resolved
    on_demand: bool = False  # not registered: the replicas' stores resolve it under adapter_source


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
# restarts it (its state is in memory unless registry_path is set).
@serve.deployment(
    name="AdapterRegistry",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
)
class AdapterRegistry:
    def __init__(self, initial: list[AdapterSpec], location: str | None = None, source: str | None = None):
        """location: registry_path (None: in memory only); source: adapter_source (None: registered names only)."""
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
        """A registered name's spec; else, with an adapter_source, an on-demand spec (no I/O here:
        the replica's store looks it up once and remembers a missing name for miss_ttl_s)."""
        spec = self._specs.get(name)
        if spec is None and self._source is not None and NAME.match(name):
            spec = AdapterSpec(name, self._source.rstrip("/") + "/" + name, 0, on_demand=True)
        return spec, self._epoch

    def list(self) -> tuple[list[AdapterSpec], int]:
        return sorted(self._specs.values(), key=lambda s: s.name), self._epoch

    def put(self, name: str, path: str, version: str | None = None) -> AdapterSpec:
        self._commit({**self._added, name: {"path": path, "version": version}}, self._removed - {name})
        self._specs[name] = AdapterSpec(name, path, self._epoch, version)
        return self._specs[name]

    def remove(self, name: str) -> bool:
        if name not in self._specs:
            return False
        removed = self._removed | {name} if name in self._scanned else self._removed
        self._commit({k: v for k, v in self._added.items() if k != name}, removed)
        del self._specs[name]
        return True
