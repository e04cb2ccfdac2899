"""Ten thousand adapters on one GPU (device only; ``--smoke`` checks the plumbing on the CPU):
Llama-2-7B shape fp16, 10,000 distinct rank-16 adapters on all seven projections, Zipf(1.1)
popularity, Poisson arrivals sized to hold a batch of 32, 64 GPU slots. The same trace is
replayed with its names folded onto 64 adapters that are all resident, in the same run:
throughput, TTFT p50/p99, loads per second, the longest wait. About 3 minutes on an H200
(each replay ~20 s when it keeps up, cut at --max-replay-s 90 when it does not).

Adapters enter through the product's own path: an AdapterStore with an on-demand root
(``adapter_source``), so every name is resolved on first use, single-flight, its content
version asked of the source on each cold load, its safetensors parsed and validated (shapes,
finite values, rank) and packed into the host LRU (``adapter_cache.host_gb``,
``adapter_cache.workers``) exactly as in serving (adapters_store/fast_load.py: a handful
of ops per load, the file read into a reused buffer, evicted host buffers reused). Only the
bytes come from a stand-in (``SlabSource``, plugged in by overriding ``AdapterStore._source``,
its ``read_into`` a memcpy that releases the GIL): 10,000 × 80 MB (800 GB)
fit on no disk or host here, so adapter i's safetensors file is a header plus an 80 MB slice
of one random fp16 slab (--slab-gb) at an offset of its own, its first 16 values stamped from
the sha256 of its name, so no two adapters hold the same content. Making one is a memcpy.
It stands in for a local NVMe / page-cache tier at the rate it sustains (measured in this run,
``source_rate``, beside the trace's demand ``demand``): not S3 over a network, not the disk
cache's verification, whose rates are not measured here. ``host_tier_rate`` is the product's
cold-load rate (source + parse + validation + pack) on its loader threads.
--source-gbps holds each read to a bandwidth, one stream of a slower tier.
A request is added to the engine once its adapter is in host memory (as AsyncEngine does,
off the engine thread); its TTFT runs from its Poisson arrival, so host loads count. A replay
still running after --max-replay-s is cut: its percentiles then count the requests with no
first token at their wait so far (lower bounds) and it says ``truncated``.

    python -m benchmarks.adapter_scale [--requests 2000] [--out benchmarks/results]
    python -m benchmarks.adapter_scale --smoke   # CPU, tiny model: the plumbing, no result written
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import date

import numpy as np
import torch

from adapters_store.gpu_pool import LoraPool, PoolConfig
from adapters_store.host_cache import HostCacheConfig
from adapters_store.sources import Staging
from adapters_store.store import StoreConfig
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.model.llama import LlamaModel
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from benchmarks.adapter_load import RANK, llama7b
from benchmarks.adapter_standin import Slab, SlabSource, StandInStore, random_weights, tiny_config

ZIPF = 1.1


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trace(n: int, adapters: int, rate: float, vocab: int, seed: int = 0):
    """(arrival s, adapter index, prompt) per request: Poisson arrivals, Zipf(1.1) popularity."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** ZIPF
    picks = rng.choice(adapters, n, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return [(float(t), int(k), tuple(int(x) for x in rng.integers(0, vocab, 64))) for t, k in zip(arrivals, picks)]


def demand(requests, nbytes: int) -> dict:
    """New adapters the trace asks for per second: over the whole trace and in its first second."""
    seen, first = set(), []
    for t, k, _ in requests:
        if k not in seen:
            seen.add(k)
            first.append(t)
    span = requests[-1][0]
    return {
        "new_adapters_per_s": round(len(first) / span, 1),
        "new_adapters_first_s": sum(t < 1.0 for t in first),
        "GBps": round(len(first) * nbytes / span / 1e9, 2),
    }


def replay(
    engine: EngineCore, store: StandInStore, requests, names, max_tokens: int, limit_s: float, warmup_s: float
) -> dict:
    """Arrivals in real time; a request joins the engine once its adapter is in host memory.
    ``steady``: the TTFTs of the requests that arrive after warmup_s (the host tier filled)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pool = engine.model.lora_pool
    loads0, misses0, made0 = pool.loads, pool.misses, store.count("load.local")
    loading: list[tuple[int, Future]] = []
    first, tokens, busy, stepping = {}, 0, 0.0, 0.0  # busy: running requests × seconds stepped
    t0, i, done = time.perf_counter(), 0, 0
    while done < len(requests) and time.perf_counter() - t0 < limit_s:
        now = time.perf_counter() - t0
        while i < len(requests) and requests[i][0] <= now:
            loading.append((i, store.prefetch(names(requests[i][1]))))
            i += 1
        still = []
        for j, fut in loading:
            if fut.done():
                engine.add(
                    GenerateRequest(f"r{j}", requests[j][2], params, names(requests[j][1])), adapter=fut.result()
                )
            else:
                still.append((j, fut))
        loading = still
        if not engine.has_work():
            time.sleep(2e-4)
            continue
        running, stepped = len(engine.scheduler.running), time.perf_counter()
        for chunk in engine.step():
            if isinstance(chunk, TokenChunk):
                j = int(chunk.request_id[1:])
                tokens += len(chunk.token_ids)
                first.setdefault(j, time.perf_counter() - t0)
                done += chunk.finish_reason is not None
        stepped = time.perf_counter() - stepped
        busy, stepping = busy + running * stepped, stepping + stepped
    _sync()
    span = time.perf_counter() - t0
    truncated = done < len(requests)
    for j in range(i):  # cut: end what is left; those still waiting count their wait so far
        engine.abort(f"r{j}")
    made = store.count("load.local") - made0
    waits = {j: first.get(j, span) - requests[j][0] for j in range(i)}
    ttft = sorted(waits.values())
    steady = sorted(w for j, w in waits.items() if requests[j][0] >= warmup_s)
    return {
        "requests": len(requests),
        "finished": done,
        "truncated": truncated,
        "seconds": round(span, 2),
        "tokens_per_s": round(tokens / span, 1),
        "mean_batch": round(busy / max(stepping, 1e-9), 1),  # running requests, weighted by step time
        **waits_ms(ttft),
        "steady": {"requests": len(steady), **waits_ms(steady)},
        "gpu_loads": pool.loads - loads0,
        "gpu_misses": pool.misses - misses0,
        "gpu_loads_per_s": round((pool.loads - loads0) / span, 1),
        "host_loads": int(made),
        "host_loads_per_s": round(made / span, 1),
        "distinct_adapters": len({names(r[1]) for r in requests}),
        "ttft_s": ttft,
    }


def waits_ms(xs: list[float]) -> dict:
    """TTFT p50 / p99 and the longest wait of sorted seconds, in ms."""
    pct = lambda q: xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]  # noqa: E731
    return {
        "ttft_p50_ms": round(pct(50) * 1e3, 1),
        "ttft_p99_ms": round(pct(99) * 1e3, 1),
        "max_wait_ms": round(xs[-1] * 1e3, 1),
    }


def request_rate(engine: EngineCore, names, batch: int, max_tokens: int, n: int) -> float:
    """Requests per second with `batch` requests always in flight (a closed loop, adapters
    resident). The first wave asks for 1, 2, ... max_tokens tokens, so that finishes, and new
    requests' prefills, are spread over the steps as Poisson arrivals spread them (a wave in
    lockstep would decode in CUDA graphs between rare prefill steps and overstate the rate)."""
    params = lambda k: SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)  # noqa: E731
    for k in range(batch):
        engine.add(GenerateRequest(f"w{k}", tuple(range(1, 65)), params(1 + k * max_tokens // batch), names(k)))
    started, finished = batch, 0
    while engine.has_work():
        for chunk in engine.step():
            if isinstance(chunk, TokenChunk) and chunk.finish_reason is not None:
                finished += 1
                if finished == 2 * batch:  # staggered by now: time the rest
                    _sync()
                    start = time.perf_counter()
                if started < n:
                    engine.add(GenerateRequest(f"w{started}", tuple(range(1, 65)), params(max_tokens), names(started)))
                    started += 1
    _sync()
    return (finished - 2 * batch) / (time.perf_counter() - start)


def rates(store: StandInStore, shape, slab: Slab, workers: int, n: int) -> dict:
    """Sustained rates, measured after the replays on names no replay used: the stand-in alone
    (``workers`` threads building adapter files), then the product's cold load through a fresh
    store (source + parse + validation + pack), both over n adapters."""
    names, staging = [f"probe{k}" for k in range(n)], Staging()
    read = lambda name: SlabSource(slab, name, store.gbps).read_into(None, staging.get)[0].nbytes  # noqa: E731
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:  # as the store reads: into each thread's reused buffer
        nbytes = sum(pool.map(read, names))
    source_s = time.perf_counter() - start
    # the trace's steady state: room for half the probes, the later half each evicting one (whose buffer it reuses)
    host = replace(store.config.host, budget_bytes=max(1, n // 2) * (nbytes // n))
    probe = StandInStore(shape, replace(store.config, host=host), slab, store.gbps)
    start = time.perf_counter()
    futures = [probe.prefetch(name) for name in names]
    while futures:  # dropped once done, so that nothing holds an evicted adapter's buffer
        futures.pop(0).result()
    host_s = time.perf_counter() - start
    probe.close()
    return {
        "source_rate": {"adapters_per_s": round(n / source_s, 1), "GBps": round(nbytes / source_s / 1e9, 2)},
        "host_tier_rate": {"adapters_per_s": round(n / host_s, 1), "GBps": round(nbytes / host_s / 1e9, 2)},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--host-gb", type=float, default=24.0, help="adapter_cache.host_gb")
    ap.add_argument("--workers", type=int, default=8, help="adapter_cache.workers (loader threads)")
    ap.add_argument("--slab-gb", type=float, default=4.0, help="random fp16 the adapters' bytes are cut from")
    ap.add_argument("--source-gbps", type=float, default=None, help="hold each adapter's read to this bandwidth")
    ap.add_argument("--max-replay-s", type=float, default=90.0, help="cut a replay still running after this")
    ap.add_argument("--load", type=float, default=0.85, help="arrivals: this fraction of the closed loop's rate")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="steady-state TTFTs: requests arriving after this")
    ap.add_argument("--probe", type=int, default=64, help="adapters per rate measurement")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small trace: plumbing only")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    a = ap.parse_args()
    if a.smoke:
        a.adapters, a.requests, a.max_tokens, a.slots, a.batch, a.probe, a.warmup_s = 300, 120, 4, 8, 4, 8, 0.0
    cfg = tiny_config() if a.smoke else llama7b()
    device, dtype = ("cpu", torch.float32) if a.smoke else ("cuda", torch.float16)
    slab = Slab(cfg, 0.01 if a.smoke else a.slab_gb, device)
    host_bytes = 40 * slab.nbytes * dtype.itemsize // 2 if a.smoke else int(a.host_gb * 2**30)  # smoke: evicts
    sconf = StoreConfig(max_rank=RANK, host=HostCacheConfig(budget_bytes=host_bytes, dtype=dtype), workers=a.workers)
    store = StandInStore(cfg.shape, sconf, slab, a.source_gbps)
    econf = EngineConfig(
        max_num_seqs=2 * a.batch,
        max_tokens_per_step=4096,
        num_kv_blocks=256 if a.smoke else 2048,
        block_size=16,
        max_loras=a.slots,
        max_lora_rank=RANK,
        dtype=dtype,
        device=device,
    )
    pool = LoraPool(cfg.shape, PoolConfig(a.slots, RANK, dtype, device))
    engine = EngineCore(LlamaModel(cfg, random_weights(cfg, device, dtype), pool), store, None, econf)
    resident = lambda k: f"r{k % a.slots}"  # noqa: E731  the baseline: `slots` adapters, all resident
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for fut in [store.prefetch(resident(k)) for k in range(a.slots)]:  # host loads in parallel, not one by one
        fut.result()
    for k in range(a.slots):  # the baseline's adapters into the GPU slots before anything is timed
        engine.add(GenerateRequest(f"warm{k}", (1, 2, 3), warm, resident(k)))
    while engine.has_work():
        engine.step()
    rate = a.load * request_rate(engine, resident, a.batch, a.max_tokens, 8 * a.batch)
    requests = trace(a.requests, a.adapters, rate, cfg.vocab_size)
    need = demand(requests, len(slab.prefix) + slab.nbytes)
    print(json.dumps({"arrivals_per_s": round(rate, 1), "demand": need}))
    base = replay(engine, store, requests, resident, a.max_tokens, a.max_replay_s, a.warmup_s)
    print(json.dumps({k: v for k, v in base.items() if k != "ttft_s"}), flush=True)
    loads0, seconds0 = store.count("load.local"), store.count("load.local.seconds")
    scale = replay(engine, store, requests, lambda k: f"a{k}", a.max_tokens, a.max_replay_s, a.warmup_s)
    print(json.dumps({k: v for k, v in scale.items() if k != "ttft_s"}), flush=True)
    while store.stats()["loading"]:  # a cut replay's loads finish before the rates are measured
        time.sleep(0.05)
    loads = store.count("load.local") - loads0
    mean_load_s = (store.count("load.local.seconds") - seconds0) / max(loads, 1)
    result = {
        "throughput_ratio": round(scale["tokens_per_s"] / base["tokens_per_s"], 3),
        "ttft_p99_ratio": round(scale["ttft_p99_ms"] / base["ttft_p99_ms"], 2),
        "steady_ttft_p99_ratio": round(scale["steady"]["ttft_p99_ms"] / base["steady"]["ttft_p99_ms"], 2),
        "targets": {"throughput_ratio_min": 0.9, "ttft_p99_ratio_max": 2.0},
        "arrivals_per_s": round(rate, 1),
        "demand": need,
        **rates(store, cfg.shape, slab, a.workers, a.probe),
        "host_load_ms_mean": round(mean_load_s * 1e3, 1),  # one cold load (source to host tier) while replaying
        # loads that left the fast path (fast_load.py) for the library's, and host buffers reused
        "cold_load": {"library_path": store.fast.fallbacks, "buffers_reused": store.host.spares.reused},
        "host_tiers": store.tiers(pool),
        "all_resident": base,
        "on_demand": scale,
    }
    summary = {k: v for k, v in result.items() if k not in ("all_resident", "on_demand", "host_tiers")}
    print(json.dumps(summary, indent=1))
    if a.smoke:
        smoke_checks(store, requests, base, scale)
        json.dumps(result)  # what a device run writes serializes
        return
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": str(date.today()),
        "torch": torch.__version__,
        "model": "Llama-2-7B shape, random fp16 weights",
        "adapters": f"{a.adapters} distinct, rank {RANK}, all 7 projections ({slab.nbytes / 1e6:.0f} MB each)",
        "slots": a.slots,
        "batch": a.batch,
        "trace": f"{a.requests} requests, Zipf({ZIPF}), Poisson at {a.load}x the batch-{a.batch} closed loop's rate, "
        f"prompt 64, {a.max_tokens} output tokens; steady: arrivals after {a.warmup_s} s",
        "source": f"AdapterStore on demand, {a.workers} loader threads, {a.host_gb} GiB host LRU; bytes cut "
        f"from a {a.slab_gb} GiB random fp16 slab by memcpy"
        + (f", each read held to {a.source_gbps} GB/s" if a.source_gbps else "")
        + ": stands in for a local NVMe tier at source_rate, not S3",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "adapter_scale_h200.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    plot(base, scale, a.out / "adapter_scale_h200.png")


def smoke_checks(store: StandInStore, requests, base: dict, scale: dict) -> None:
    """What the plumbing must do whatever the speed: every request served, the host LRU evicting,
    each adapter its own content under the version its source gave."""
    assert not base["truncated"] and not scale["truncated"], "a replay was cut"
    assert base["finished"] == scale["finished"] == len(requests)
    assert store.tiers()["host"]["eviction"] > 0, "the host LRU never evicted: the smoke budget is too large"
    assert store.fast.fallbacks == 0, "a stand-in adapter left the fast path"
    assert store.host.spares.reused > 0, "no evicted host buffer was reused"
    one, two = (f"a{k}" for k in sorted({r[1] for r in requests})[:2])
    w1, w2 = store.get(one), store.get(two)
    assert w1.version == store.version(one) == SlabSource(store.slab, one).snapshot().version != w2.version
    key = next(iter(w1.tensors))  # the first matrix of each: the stamp and the slab offset both differ
    assert not torch.equal(w1.tensors[key][0], w2.tensors[key][0]), "two adapters share content"
    print("smoke: ok")


def plot(base: dict, scale: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, label in (
        (base, "64 adapters, all resident"),
        (scale, f"{scale['distinct_adapters']} of 10,000 on demand"),
    ):
        xs = run["ttft_s"]
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot([x * 1e3 for x in xs], ys, label=f"{label}: {run['tokens_per_s']:.0f} tok/s")
    ax.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests")
    ax.set_title("Zipf(1.1) trace, batch ~32, 64 slots, Llama-2-7B shape, H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
