"""Ten thousand adapters on one GPU (device only): Llama-2-7B shape fp16, 10,000 distinct
rank-16 adapters on all seven projections, Zipf(1.1) popularity, Poisson arrivals sized to
hold a batch of 32, 64 GPU slots. The same trace is replayed with its names folded onto 64
adapters that are all resident, in the same run: throughput, TTFT p50/p99, loads per second,
the longest wait.

What stands in for S3: 10,000 × 80 MB (800 GB) cannot sit in host memory, so adapters are
made on demand by loader threads (``GeneratedSource``) into the real host tier (HostCache,
pinned fp16, LRU under --host-gb), single-flight per name, as AdapterStore does. Making one
is a copy of an 80 MB prototype plus distinct random rows for that adapter (every adapter's
bytes differ; kernel speed does not depend on values), optionally throttled to
--source-gbps per stream to stand in for S3 bandwidth. It measures the host→GPU tier
(64 slots, async copies), the scheduler's admission under slot pressure and the host tier's
reload rate; it does not measure S3 latency or the disk tier.
A request is added to the engine once its adapter is in host memory (as AsyncEngine does,
off the engine thread); its TTFT runs from its Poisson arrival, so host loads count.

    python benchmarks/adapter_scale.py [--requests 6000] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import date

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from adapters_store.gpu_pool import LoraPool, PoolConfig  # noqa: E402
from adapters_store.host_cache import HostCache, HostCacheConfig  # noqa: E402
from adapters_store.peft_weights import LoraWeights, ModuleStack  # noqa: E402
from adapters_store.single_flight import SingleFlight  # noqa: E402
from app.engine.config import EngineConfig  # noqa: E402
from app.engine.core import EngineCore  # noqa: E402
from app.model.llama import LlamaModel  # noqa: E402
from app.protocol import GenerateRequest, SamplingParams, TokenChunk  # noqa: E402
from benchmarks.adapter_load import DTYPE, RANK, llama7b, random_adapter, random_weights  # noqa: E402

SLOTS, BATCH, ZIPF = 64, 32, 1.1


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _view(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return buffer.as_strided(t.shape, t.stride(), t.storage_offset())


class GeneratedSource:
    """Adapters by name, made on demand into a bounded pinned host LRU (see the module doc)."""

    def __init__(self, proto: LoraWeights, host_bytes: int, workers: int, source_gbps: float | None):
        self.proto, self.source_gbps = proto, source_gbps
        self.pin = torch.cuda.is_available()
        self.host = HostCache(HostCacheConfig(budget_bytes=host_bytes, pin_memory=self.pin, dtype=proto.buffer.dtype))
        self.flights = SingleFlight(ThreadPoolExecutor(workers, thread_name_prefix="gen"))
        self.lock = threading.Lock()
        self.made = self.hits = 0

    def prefetch(self, name: str) -> Future:
        weights = self.host.get((name, "1"))
        if weights is not None:
            with self.lock:
                self.hits += 1
            done: Future = Future()
            done.set_result(weights)
            return done
        return self.flights.submit(name, lambda: self._make(name))

    def get(self, name: str) -> LoraWeights:
        return self.prefetch(name).result()

    def _make(self, name: str) -> LoraWeights:
        start, p = time.perf_counter(), self.proto
        buffer = torch.empty_like(p.buffer, pin_memory=self.pin)
        buffer.copy_(p.buffer)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        for st in p.stacks.values():  # this adapter's own first row of A in every layer
            _view(buffer, st.A)[:, 0].copy_(torch.randn(st.A.shape[0], st.A.shape[2], generator=gen) * 0.01)
        stacks = {m: ModuleStack(st.layers, _view(buffer, st.A), _view(buffer, st.Bt)) for m, st in p.stacks.items()}
        tensors = {k: (_view(buffer, a), _view(buffer, b)) for k, (a, b) in p.tensors.items()}
        weights = replace(p, name=name, version="1", buffer=buffer, stacks=stacks, tensors=tensors)
        if self.source_gbps:  # the rest of an S3 download at this bandwidth
            time.sleep(max(0.0, weights.nbytes / (self.source_gbps * 1e9) - (time.perf_counter() - start)))
        with self.lock:
            self.made += 1
        return self.host.put(weights)


def trace(n: int, adapters: int, rate: float, seed: int = 0):
    """(arrival s, adapter index, prompt) per request: Poisson arrivals, Zipf(1.1) popularity."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** ZIPF
    picks = rng.choice(adapters, n, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return [(float(t), int(k), tuple(int(x) for x in rng.integers(0, 32000, 64))) for t, k in zip(arrivals, picks)]


def replay(engine: EngineCore, source: GeneratedSource, requests, names, max_tokens: int) -> dict:
    """Arrivals in real time; a request joins the engine once its adapter is in host memory."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pool = engine.model.lora_pool
    loads0, misses0, made0 = pool.loads, pool.misses, source.made
    loading: list[tuple[int, Future]] = []
    first, added, tokens, waits = {}, {}, 0, []
    t0, i, done = time.perf_counter(), 0, 0
    while done < len(requests):
        now = time.perf_counter() - t0
        while i < len(requests) and requests[i][0] <= now:
            loading.append((i, source.prefetch(names(requests[i][1]))))
            i += 1
        still = []
        for j, fut in loading:
            if fut.done():
                engine.add(
                    GenerateRequest(f"r{j}", requests[j][2], params, names(requests[j][1])), adapter=fut.result()
                )
                added[j] = now
            else:
                still.append((j, fut))
        loading = still
        if not engine.has_work():
            time.sleep(2e-4)
            continue
        for chunk in engine.step():
            if isinstance(chunk, TokenChunk):
                j = int(chunk.request_id[1:])
                tokens += len(chunk.token_ids)
                if j not in first:
                    first[j] = time.perf_counter() - t0
                    waits.append(first[j] - requests[j][0])
                done += chunk.finish_reason is not None
    _sync()
    span = time.perf_counter() - t0
    ttft = sorted(first[j] - requests[j][0] for j in first)
    pct = lambda q: ttft[min(len(ttft) - 1, int(round(q / 100 * (len(ttft) - 1))))]  # noqa: E731
    return {
        "requests": len(requests),
        "seconds": round(span, 2),
        "tokens_per_s": round(tokens / span, 1),
        "ttft_p50_ms": round(pct(50) * 1e3, 1),
        "ttft_p99_ms": round(pct(99) * 1e3, 1),
        "max_wait_ms": round(max(waits) * 1e3, 1),
        "gpu_loads": pool.loads - loads0,
        "gpu_misses": pool.misses - misses0,
        "gpu_loads_per_s": round((pool.loads - loads0) / span, 1),
        "host_loads": source.made - made0,
        "host_loads_per_s": round((source.made - made0) / span, 1),
        "distinct_adapters": len({names(r[1]) for r in requests}),
        "ttft_s": ttft,
    }


def step_seconds(engine: EngineCore, names, max_tokens: int) -> float:
    """Median decode step at batch BATCH, adapters resident: sizes the Poisson rate."""
    for k in range(BATCH):
        engine.add(
            GenerateRequest(
                f"w{k}",
                tuple(range(1, 65)),
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                names(k),
            )
        )
    times = []
    while engine.has_work():
        s = time.perf_counter()
        engine.step()
        _sync()
        times.append(time.perf_counter() - s)
    return float(np.median(times[2:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--host-gb", type=float, default=24.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--source-gbps", type=float, default=None, help="throttle each made adapter to this bandwidth")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    a = ap.parse_args()
    cfg = llama7b()
    proto = random_adapter(cfg)
    econf = EngineConfig(
        max_num_seqs=2 * BATCH,
        max_tokens_per_step=4096,
        num_kv_blocks=2048,
        block_size=16,
        max_loras=SLOTS,
        max_lora_rank=RANK,
        dtype=DTYPE,
        device="cuda",
    )
    source = GeneratedSource(proto, int(a.host_gb * 2**30), a.workers, a.source_gbps)
    engine = EngineCore(
        LlamaModel(cfg, random_weights(cfg), LoraPool(cfg.shape, PoolConfig(SLOTS, RANK, DTYPE, "cuda"))),
        source,
        None,
        econf,
    )
    resident = lambda k: f"r{k % SLOTS}"  # noqa: E731  the baseline: 64 adapters, all resident
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for k in range(SLOTS):  # the baseline's 64 adapters into the GPU slots before anything is timed
        engine.add(GenerateRequest(f"warm{k}", (1, 2, 3), warm, resident(k)))
    while engine.has_work():
        engine.step()
    step_s = step_seconds(engine, resident, a.max_tokens)
    rate = BATCH / ((a.max_tokens + 1) * step_s)  # Little's law: BATCH requests in flight on average
    requests = trace(a.requests, a.adapters, rate)
    print(json.dumps({"decode_step_ms": round(step_s * 1e3, 2), "arrivals_per_s": round(rate, 1)}), flush=True)
    base = replay(engine, source, requests, resident, a.max_tokens)
    print(json.dumps({k: v for k, v in base.items() if k != "ttft_s"}), flush=True)
    scale = replay(engine, source, requests, lambda k: f"a{k}", a.max_tokens)
    print(json.dumps({k: v for k, v in scale.items() if k != "ttft_s"}), flush=True)
    result = {
        "throughput_ratio": round(scale["tokens_per_s"] / base["tokens_per_s"], 3),
        "ttft_p99_ratio": round(scale["ttft_p99_ms"] / base["ttft_p99_ms"], 2),
        "targets": {"throughput_ratio_min": 0.9, "ttft_p99_ratio_max": 2.0},
        "decode_step_ms": round(step_s * 1e3, 2),
        "arrivals_per_s": round(rate, 1),
        "all_resident_64": base,
        "on_demand_10k": scale,
        "host_hits": source.hits,
        "host_made": source.made,
    }
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": str(date.today()),
        "torch": torch.__version__,
        "model": "Llama-2-7B shape, random fp16 weights",
        "adapters": f"{a.adapters} distinct, rank {RANK}, all 7 projections ({proto.nbytes / 1e6:.0f} MB each)",
        "slots": SLOTS,
        "batch": BATCH,
        "trace": f"{a.requests} requests, Zipf({ZIPF}), Poisson, prompt 64, {a.max_tokens} output tokens",
        "source": f"generated into a {a.host_gb} GiB pinned host LRU by {a.workers} threads"
        + (f", throttled to {a.source_gbps} GB/s each" if a.source_gbps else " (no S3 latency)"),
    }
    summary = {k: v for k, v in result.items() if k not in ("all_resident_64", "on_demand_10k")}
    print(json.dumps(summary, indent=1))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "adapter_scale_h200.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    plot(base, scale, a.out / "adapter_scale_h200.png")


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
        ax.plot(
            [x * 1e3 for x in xs],
            [(i + 1) / len(xs) for i in range(len(xs))],
            label=f"{label}: {run['tokens_per_s']:.0f} tok/s",
        )
    ax.set(
        xscale="log",
        xlabel="time to first token (ms)",
        ylabel="fraction of requests",
        title="Zipf(1.1) trace, batch ~32, 64 slots, Llama-2-7B shape, H200",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
