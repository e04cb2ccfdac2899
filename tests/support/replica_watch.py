"""ReplicaWatch: which LoraReplica replicas of one Serve app exist, and what each reports,
sampled from a thread (for the real-Serve autoscaling tests).

A replica is its Serve actor (`SERVE_REPLICA::<app>#LoraReplica#<replica id>`), alive
from the moment Serve starts it until Serve kills it; it reports routing stats once its
constructor has run. All replicas are asked at once, so one slow or stopping replica
does not stretch the sampling period.
"""

from __future__ import annotations

import threading
import time


class ReplicaWatch:
    def __init__(self, app: str, period_s: float = 0.2):
        self.prefix = f"SERVE_REPLICA::{app}#LoraReplica#"
        self.period_s = period_s
        self.samples: dict[str, list[tuple[float, dict]]] = {}  # replica id → [(time, routing stats)]
        self.present: list[tuple[float, frozenset[str]]] = []  # (time, replica ids alive)
        self._handles = {}
        self._asked = {}  # call in flight → actor name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ReplicaWatch:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        import ray

        names = [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(self.prefix)
        ]
        for name in names:  # one call in flight per replica: a slow one is asked again once it answers
            if name not in self._handles:
                self._handles[name] = ray.get_actor(name, namespace="serve")
            if name not in self._asked.values():
                self._asked[self._handles[name].record_routing_stats.remote()] = name
        ready, _ = ray.wait(list(self._asked), num_returns=len(self._asked), timeout=0.2)
        now = time.time()
        for ref in ready:
            name = self._asked.pop(ref)
            try:
                stats = ray.get(ref)
            except Exception:  # still in its constructor, or stopped: no sample
                continue
            if stats:
                self.samples.setdefault(name[len(self.prefix) :], []).append((now, stats))
        self.present.append((now, frozenset(n[len(self.prefix) :] for n in names)))

    def names(self) -> set[str]:
        """Replica ids alive at the last sample."""
        return set(self.present[-1][1]) if self.present else set()

    def ever(self) -> set[str]:
        """Every replica id seen alive while watching."""
        return set().union(*(ids for _, ids in self.present))

    def most_at_once(self) -> int:
        return max((len(ids) for _, ids in self.present), default=0)

    def gone_at(self, name: str) -> float | None:
        """When the replica was first seen gone after being alive (None: still alive)."""
        seen = False
        for at, ids in self.present:
            seen = seen or name in ids
            if seen and name not in ids:
                return at
        return None

    def reporting(self) -> set[str]:
        """Alive replicas that have reported stats (constructed, serving)."""
        return {n for n in self.names() if n in self.samples}

    def latest(self, name: str) -> dict:
        return self.samples[name][-1][1] if self.samples.get(name) else {}

    def all_idle(self) -> bool:
        return all(self.latest(n).get("running") == 0 and self.latest(n).get("waiting") == 0 for n in self.names())

    def oldest(self) -> str:
        return min(self.reporting(), key=lambda n: self.latest(n)["started_at"])

    def samples_since(self, name: str, t: float, until: float = float("inf")) -> list[dict]:
        return [s for at, s in self.samples.get(name, []) if t <= at <= until]
