"""The app's adapter registry: one small deployment every ingress and replica reads.

Registration must reach every LoraReplica, including replicas started later by
autoscaling. Rather than broadcast, the registry is the single source of truth:
the ingress resolves each request's adapter here and sends its AdapterSpec
(name, path, serial) along, so any replica can register it on demand (the
engine's AdapterStore then loads it and tracks its content version); each change
bumps an epoch, and a replica that sees a newer epoch re-reads the list and
drops the adapters that were unregistered. Runtime registrations live in this
actor's memory (a restarted registry starts again from `adapter_dirs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ray import serve


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str  # a local PEFT directory (or an s3:// URI the AdapterStore reads)
    serial: int  # the registry epoch of its registration: registering a name again is a new spec


def scan(dirs) -> list[AdapterSpec]:
    """Every PEFT directory directly under each of dirs (a later dir wins a name clash)."""
    from app.generate import local_adapters  # here: the registry actor itself need not import torch

    found: dict[str, str] = {}
    for d in dirs:
        found.update(local_adapters(Path(d)))
    return [AdapterSpec(name, path, 0) for name, path in sorted(found.items())]


@serve.deployment(name="AdapterRegistry", num_replicas=1, ray_actor_options={"num_cpus": 0})
class AdapterRegistry:
    def __init__(self, initial: list[AdapterSpec]):
        self._specs = {s.name: s for s in initial}
        self._epoch = 0

    def lookup(self, name: str) -> tuple[AdapterSpec | None, int]:
        return self._specs.get(name), self._epoch

    def list(self) -> tuple[list[AdapterSpec], int]:
        return sorted(self._specs.values(), key=lambda s: s.name), self._epoch

    def put(self, name: str, path: str) -> AdapterSpec:
        self._epoch += 1
        self._specs[name] = AdapterSpec(name, path, self._epoch)
        return self._specs[name]

    def remove(self, name: str) -> bool:
        if self._specs.pop(name, None) is None:
            return False
        self._epoch += 1
        return True
