"""The cold-load path of one adapter, phase by phase, and the rate the store sustains with 1, 2,
4 (8) loads in flight, alone and beside an engine-like thread (CPU or CUDA; no result file).

Llama-2-7B shape, rank-16 fp16 adapters on all seven projections (80 MB each) from the
benchmark's stand-in source (benchmarks/adapter_standin.py, a memcpy out of a random slab):
phases are the store's own steps (adapters_store/store.py ``_load``, fast_load.py), timed
one after another on one thread; the rates go through ``AdapterStore.prefetch`` (single
flight, loader threads, host LRU). The engine-like thread runs small torch ops and a little
Python in a loop, as a decode step does: it competes for the GIL, which every torch call
releases and takes back. ``engine_its`` is its loop rate, to compare with ``engine_alone``.
On CUDA it first measures what decided that the host tier is not page-locked (``pinning``):
a fresh pinned 128 MiB buffer's time, and a GPU loop's rate while buffers are pinned beside it.

    python -m benchmarks.adapter_cold_load [--loads 24] [--flight 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from adapters_store.gpu_pool import LoraPool, PoolConfig
from adapters_store.host_cache import HostCache, HostCacheConfig
from adapters_store.manifest import parse_manifest
from adapters_store.sources import Staging
from adapters_store.store import StoreConfig
from benchmarks.adapter_load import RANK, llama7b
from benchmarks.adapter_standin import Slab, SlabSource, StandInStore

DTYPE = torch.float16


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(store: StandInStore, pool: LoraPool, n: int, clock=time.perf_counter) -> dict:
    """Median ms per phase over n adapters, one thread, in the store's order. The host buffer is
    allocated as the store does in steady state: an evicted adapter's, reused (host_cache.Spares)."""
    staging, times = Staging(), {}
    for k in range(n + 2):  # the first two warm the plan cache, the staging buffer and the spare
        t = [clock()]
        source = SlabSource(store.slab, f"phase{k}")
        snap = source.snapshot()
        t.append(clock())
        raw, _ = source.read_into(snap, staging.get)
        t.append(clock())
        manifest = parse_manifest(snap.config, store.config.max_rank)
        plan = store.fast.plan(raw, manifest)
        t.append(clock())
        data = torch.from_numpy(raw[plan.data_start :]).view(plan.dtype)
        lo, hi = torch.aminmax(data)
        assert bool(torch.isfinite(lo) & torch.isfinite(hi))
        t.append(clock())
        buf = store.host.alloc(plan.numel)  # the previous adapter's (given back below)
        t.append(clock())
        buf.copy_(data)
        t.append(clock())
        weights = store.fast.load(source.name, manifest, raw, snap.version, lambda numel, b=buf: b)  # views (+ checks)
        t.append(clock())
        slot = pool.acquire(weights)
        while not pool.ready(slot):
            time.sleep(1e-4)
        _sync()
        pool.release((weights.name, weights.version))
        t.append(clock())
        del weights, data
        store.host.spares.give(buf)
        del buf
        if k >= 2:
            names = ("snapshot", "fetch", "header_plan", "finite", "alloc", "copy", "views_again", "slot_copy")
            for name, a, b in zip(names, t, t[1:]):
                times.setdefault(name, []).append((b - a) * 1e3)
    out = {k: round(statistics.median(v), 2) for k, v in times.items()}
    out["views_again"] = f"{out['views_again']} (finite + copy + views: the loader's own call, again)"
    return out


def engine_loop(stop: threading.Event, count: list[int]) -> None:
    x = torch.zeros(64)
    while not stop.is_set():
        for _ in range(20):  # a step's small launches
            x = x + 1
        sum(range(200))  # and its Python
        count[0] += 1


def rate(shape, slab: Slab, flight: int, n: int, engine: bool) -> dict:
    # room for 8: the steady state of a large adapter set, each load evicting (and reusing) one
    host = HostCacheConfig(budget_bytes=8 * slab.nbytes, dtype=DTYPE)
    store = StandInStore(shape, StoreConfig(max_rank=RANK, host=host, workers=flight), slab)
    stop, count = threading.Event(), [0]
    thread = threading.Thread(target=engine_loop, args=(stop, count)) if engine else None
    if thread:
        thread.start()
    start = time.perf_counter()
    futures = [store.prefetch(f"f{flight}_{k}") for k in range(n)]
    while futures:  # dropped once done: an adapter nothing holds can give its buffer to a later load
        futures.pop(0).result()
    seconds = time.perf_counter() - start
    reused = store.host.spares.reused
    stop.set()
    if thread:
        thread.join()
    store.close()
    out = {"loads_per_s": round(n / seconds, 1), "GBps": round(n * slab.nbytes / seconds / 1e9, 2), "reused": reused}
    if engine:
        out["engine_its"] = round(count[0] / seconds)
    return out


def pinning(n: int = 8) -> dict:
    """ms per fresh pinned 128 MiB buffer, and the iterations/s of a GPU loop (matmuls and a sync,
    a decode step's pattern) idle and while those buffers are pinned from another thread."""
    stop, its = threading.Event(), [0]

    def gpu():
        a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
        while not stop.is_set():
            for _ in range(5):
                a @ a
            torch.cuda.synchronize()
            its[0] += 1

    thread = threading.Thread(target=gpu)
    thread.start()
    time.sleep(1.0)
    i0, start = its[0], time.perf_counter()
    time.sleep(1.0)
    idle = (its[0] - i0) / (time.perf_counter() - start)
    i0, start, times, keep = its[0], time.perf_counter(), [], []
    for _ in range(n):
        t = time.perf_counter()
        keep.append(torch.empty(128 << 20, dtype=torch.uint8, pin_memory=True))
        times.append((time.perf_counter() - t) * 1e3)
    beside = (its[0] - i0) / (time.perf_counter() - start)
    stop.set()
    thread.join()
    return {
        "pin_128MiB_ms": round(statistics.median(times), 1),
        "gpu_its_idle": round(idle),
        "gpu_its_pinning": round(beside, 1),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", type=int, default=24, help="adapters per rate measurement")
    ap.add_argument("--phases", type=int, default=8, help="adapters timed phase by phase")
    ap.add_argument("--flight", type=int, nargs="+", default=[1, 2, 4], help="loads in flight (loader threads)")
    ap.add_argument("--slab-gb", type=float, default=0.5)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    cfg = llama7b()
    slab = Slab(cfg, a.slab_gb, "cuda" if cuda else "cpu")
    host = HostCacheConfig(budget_bytes=4 * slab.nbytes, dtype=DTYPE)
    store = StandInStore(cfg.shape, StoreConfig(max_rank=RANK, host=host), slab)
    store.host = HostCache(host)
    pool = LoraPool(cfg.shape, PoolConfig(2, RANK, DTYPE, "cuda" if cuda else "cpu"))
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "threads": torch.get_num_threads()}))
    if cuda:
        print(json.dumps({"pinning": pinning()}), flush=True)
    for clock in (time.perf_counter, time.thread_time):  # wall, and this thread's CPU
        print(json.dumps({clock.__name__: phases(store, pool, a.phases, clock), "fallbacks": store.fast.fallbacks}))
    print(json.dumps({"host_buffers_reused": store.host.spares.reused}))
    stop, count = threading.Event(), [0]
    start = time.perf_counter()
    threading.Timer(2.0, stop.set).start()
    engine_loop(stop, count)
    print(json.dumps({"engine_alone_its": round(count[0] / (time.perf_counter() - start))}))
    for flight in a.flight:
        alone = rate(cfg.shape, slab, flight, a.loads, False)
        beside = rate(cfg.shape, slab, flight, a.loads, True)
        print(json.dumps({"in_flight": flight, "alone": alone, "beside_engine": beside}), flush=True)


if __name__ == "__main__":
    main()
