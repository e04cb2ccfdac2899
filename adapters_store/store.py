"""AdapterStore: adapter names → sources, and loads through the tiers
S3 (or a local directory) → verified disk cache → host LRU, single-flight.

The engine thread never waits on S3: it calls ``peek`` (no I/O) and, on a miss,
``prefetch`` (a Future completed by the store's loader threads); ``get`` blocks,
``aget`` awaits. A name's identity is (name, version): every cold load (a host
miss) re-resolves the version (S3 ETag/VersionId, file sha256), so an adapter
re-uploaded under the same name is served with its new weights from its next
cold load on, never the stale ones; ``register`` forgets the old version at once.
With ``default_root`` set, an unregistered name loads from ``root/<name>/`` on
first use (the on-demand source, ``adapter_source`` in serve_config.yaml). Unknown
and invalid adapters are remembered for ``miss_ttl_s`` (no request storms on S3);
transient source failures (AdapterFetchError) are not, so the next request retries.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from adapters_store.disk_cache import DiskCache
from adapters_store.errors import (
    AdapterError,
    AdapterFetchError,
    AdapterNotFoundError,
    InvalidAdapterError,
    SourceChangedError,
    UnknownAdapterError,
)
from adapters_store.fast_load import FastLoader
from adapters_store.host_cache import HostCache
from adapters_store.manifest import parse_manifest
from adapters_store.metrics import StoreMetrics
from adapters_store.paths import NAME, S3Uri, check_name, parse_uri
from adapters_store.peft_weights import LoraWeights, ModelShape
from adapters_store.s3_source import S3Source, make_client
from adapters_store.single_flight import SingleFlight
from adapters_store.sources import LocalSource, Snapshot, Source, Staging, read_staged
from adapters_store.store_config import StoreConfig

_MAX_REMEMBERED_FAILURES = 4096


def _done(result=None, error: BaseException | None = None) -> Future:
    fut: Future = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
    return fut


class AdapterStore:
    def __init__(
        self,
        shape: ModelShape,
        config: StoreConfig = StoreConfig(),
        s3_client=None,
        metrics: StoreMetrics | None = None,
    ):
        """s3_client: a boto3 S3 client (default: made from config.s3 on first S3 use)."""
        self.shape, self.config = shape, config
        self.metrics = metrics or StoreMetrics()
        self.host = HostCache(config.host, on_evict=lambda key: self.metrics.event("host", "eviction"))
        self._s3_client, self._disk = s3_client, None
        self._default_root = parse_uri(config.default_root) if config.default_root else None
        self._lock = threading.Lock()
        self._uris: dict[str, S3Uri | Path] = {}
        self._gen: dict[str, int] = {}  # bumped by (un)register: results of older loads are not kept
        self._next_gen = itertools.count(1)
        self._snapshots: dict[str, tuple[int, Snapshot]] = {}
        self._failures: dict[str, tuple[int, float, Exception]] = {}  # name → (gen, expires, error)
        self._executor = ThreadPoolExecutor(config.workers, thread_name_prefix="adapter-load")
        self._flights = SingleFlight(self._executor)
        self._staging = Staging()
        self.fast = FastLoader(shape)  # plans of the files' layouts (adapters_store/fast_load.py)

    # -- registry -----------------------------------------------------------------------------------
    def register(self, name: str, uri: str | Path) -> None:
        """Map name → a local PEFT directory or ``s3://bucket/prefix/name/``. No I/O: the next
        get() resolves the current version (validate eagerly with ``get(name)``)."""
        check_name(name)
        location = parse_uri(uri)
        with self._lock:
            self._uris[name] = location
            self._forget(name)

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._uris.pop(name, None) is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            self._forget(name)
        self.host.drop_name(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._uris)

    def version(self, name: str) -> str | None:
        """The version last resolved for name (None before its first load)."""
        with self._lock:
            snap = self._snapshots.get(name)
            return snap[1].version if snap and snap[0] == self._gen.get(name, 0) else None

    # -- loading ------------------------------------------------------------------------------------
    def peek(self, name: str) -> LoraWeights | None:
        """The adapter if it is in host memory now; never blocks, never does I/O."""
        with self._lock:
            return self._cached(name)

    def prefetch(self, name: str) -> Future:
        """Future[LoraWeights]: done at once on a host hit; else one shared load per adapter.
        Its exception is AdapterNotFoundError, InvalidAdapterError or AdapterFetchError."""
        with self._lock:
            gen, cached = self._gen.get(name, 0), self._cached(name)
            failure, location = self._failure(name, gen), self._location(name)
        if cached is not None:
            self.metrics.event("host", "hit")
            return _done(cached)
        if failure is not None:
            return _done(error=type(failure)(*failure.args))  # a fresh exception: no shared traceback
        if location is None:
            return _done(error=UnknownAdapterError(f"adapter {name!r} does not exist"))
        return self._flights.submit((name, gen), partial(self._load, name, gen, location))

    def get(self, name: str, timeout: float | None = None) -> LoraWeights:
        with _named(name):
            return self.prefetch(name).result(timeout)

    async def aget(self, name: str) -> LoraWeights:
        with _named(name):
            return await asyncio.wrap_future(self.prefetch(name))

    def stats(self) -> dict:
        return {
            "registered": len(self._uris),
            "host_entries": len(self.host),
            "host_bytes": self.host.nbytes,
            "disk_bytes": self._disk.nbytes if self._disk else 0,
            "loading": self._flights.running(),
            **self.metrics.snapshot(),
        }

    def tiers(self, pool=None) -> dict:
        """Per tier (gpu when a LoraPool is given, host, disk): resident adapters, bytes, budget,
        hits / misses / loads / evictions; and the load-seconds histogram by source."""
        counts, disk = self.metrics.snapshot(), self._disk
        tier = lambda t: {e: int(counts.get(f"{t}.{e}", 0)) for e in ("hit", "miss", "eviction")}  # noqa: E731
        out = {
            "host": {
                "resident": len(self.host),
                "bytes": self.host.nbytes,
                "budget_bytes": self.config.host.budget_bytes,
                "load": int(counts.get("load.disk", 0) + counts.get("load.s3", 0) + counts.get("load.local", 0)),
                **tier("host"),
            },
            "disk": {
                "resident": len(disk) if disk else 0,
                "bytes": disk.nbytes if disk else 0,
                "budget_bytes": self.config.disk.budget_bytes,
                "load": int(counts.get("load.s3", 0)),
                **tier("disk"),
            },
        }
        if pool is not None:
            out["gpu"] = {
                "resident": len(pool.resident()),
                "pinned": pool.pinned(),
                "slots": pool.config.num_slots,
                "bytes": len(pool.resident()) * pool.slot_bytes,
                "budget_bytes": pool.config.num_slots * pool.slot_bytes,
                "hit": pool.hits,
                "miss": pool.misses,
                "load": pool.loads,
                "eviction": pool.evictions,
            }
        self.metrics.publish(out)
        return {**out, "load_seconds": self.metrics.histograms()}

    def describe(self) -> dict:
        """The store's configuration as it runs: source and each tier's budget."""
        c = self.config
        return {
            "source": c.default_root,
            "host_budget_bytes": c.host.budget_bytes,
            "disk_budget_bytes": c.disk.budget_bytes,
            "disk_dir": str(c.disk.root),
            "miss_ttl_s": c.miss_ttl_s,
            "max_rank": c.max_rank,
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals (callers of the _ methods below that touch dicts hold self._lock) ------------------
    def _forget(self, name: str) -> None:
        self._gen[name] = next(self._next_gen)
        self._snapshots.pop(name, None)
        self._failures.pop(name, None)

    def _location(self, name: str) -> S3Uri | Path | None:
        if name in self._uris:
            return self._uris[name]
        if isinstance(self._default_root, S3Uri) and NAME.match(name):
            return self._default_root.child(name)
        if isinstance(self._default_root, Path) and NAME.match(name):
            return self._default_root / name
        return None

    def _cached(self, name: str) -> LoraWeights | None:
        snap = self._snapshots.get(name)
        if snap is None or snap[0] != self._gen.get(name, 0):
            return None
        return self.host.get((name, snap[1].version))

    def _failure(self, name: str, gen: int) -> Exception | None:
        entry = self._failures.get(name)
        if entry is None or entry[0] != gen or entry[1] < time.monotonic():
            return None
        return entry[2]

    def _remember(self, name: str, gen: int, *, snap: Snapshot | None = None, error: Exception | None = None):
        with self._lock:
            if self._gen.get(name, 0) != gen:
                return  # re-registered meanwhile: this result describes an older registration
            if snap is not None:
                self._snapshots[name] = (gen, snap)
                return
            self._snapshots.pop(name, None)  # after the TTL, resolve again: it may have been fixed
            if isinstance(error, (AdapterNotFoundError, InvalidAdapterError)):
                if len(self._failures) >= _MAX_REMEMBERED_FAILURES:
                    now = time.monotonic()
                    self._failures = {k: v for k, v in self._failures.items() if v[1] >= now}
                self._failures[name] = (gen, time.monotonic() + self.config.miss_ttl_s, error)

    def _source(self, location: S3Uri | Path) -> Source:
        if isinstance(location, Path):
            return LocalSource(location)
        with self._lock:
            if self._s3_client is None:
                try:
                    self._s3_client = make_client(self.config.s3)
                except Exception as exc:  # botocore's config errors (unknown profile, bad endpoint) vary
                    raise AdapterFetchError(f"cannot create the S3 client: {type(exc).__name__}: {exc}") from None
            if self._disk is None:
                self._disk = DiskCache(self.config.disk, on_evict=lambda path: self.metrics.event("disk", "eviction"))
        return S3Source(location, self._s3_client, self._disk, self.config.s3)

    def _snapshot(self, name: str, gen: int, source: Source) -> Snapshot:
        """The name's current content version, asked of the source on every cold load: a
        changed object becomes a new (name, version) key in every tier."""
        snap = source.snapshot()
        self._remember(name, gen, snap=snap)
        return snap

    def _load(self, name: str, gen: int, location: S3Uri | Path) -> LoraWeights:
        with self._lock:  # a flight that ended between prefetch's check and this one's start
            failure = self._failure(name, gen)
        if failure is not None:
            raise type(failure)(*failure.args)
        try:
            source = self._source(location)
            snap = self._snapshot(name, gen, source)
            weights = self.host.get((name, snap.version))
            if weights is not None:  # this version is cached under an older registration
                return weights
            self.metrics.event("host", "miss")
            start = time.monotonic()
            raw, tier = read_staged(source, snap, self._staging)  # this thread's buffer, reused
            if tier != "local":
                self.metrics.event("disk", "hit" if tier == "disk" else "miss")
            manifest = parse_manifest(snap.config, self.config.max_rank)
            weights = self.host.put(self.fast.load(name, manifest, raw, snap.version, self.host.alloc))
            self.metrics.load(tier, raw.nbytes, time.monotonic() - start)
            return weights
        except (AdapterNotFoundError, InvalidAdapterError, SourceChangedError) as exc:
            self.metrics.error(type(exc).__name__)
            if isinstance(exc, AdapterNotFoundError) and name not in self._uris:  # on demand: the asker is a tenant
                exc = UnknownAdapterError(f"adapter {name!r} does not exist")
            self._remember(name, gen, error=exc)
            raise exc from None
        except AdapterFetchError:
            self.metrics.error(AdapterFetchError.__name__)  # one counter for every kind of transient failure
            raise


@contextmanager
def _named(name: str):
    """A load's failure names the adapter it was for (what a tenant is told instead of its location)."""
    try:
        yield
    except AdapterError as exc:
        exc.adapter = name
        raise
