"""Adapter loading on the GPU (device only): host→GPU copy of a Llama-2-7B rank-16
adapter on all seven projections beside the measured pinned bandwidth, and a
cold-start burst — 64 requests for 64 non-resident adapters arriving within 100 ms
while 32 other requests decode — against the same burst with the adapters resident.

    python -m benchmarks.adapter_load [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from adapters_store.gpu_pool import LoraPool, PoolConfig
from adapters_store.host_cache import pack
from adapters_store.manifest import AdapterManifest
from adapters_store.peft_weights import LoraWeights
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.model.config import ModelConfig
from app.model.llama import LlamaModel
from app.model.weights import FUSED, LayerWeights, ModelWeights
from app.protocol import GenerateRequest, SamplingParams

RANK, DEV, DTYPE = 16, "cuda", torch.float16


def llama7b() -> ModelConfig:
    from transformers import LlamaConfig

    return ModelConfig.from_hf(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            eos_token_id=None,
        )
    )


def random_weights(cfg: ModelConfig) -> ModelWeights:
    """Random weights (speed does not depend on their values), made on the GPU."""
    rnd = lambda *shape: torch.randn(*shape, device=DEV, dtype=DTYPE) * 0.02  # noqa: E731
    dims = cfg.module_dims

    def layer():
        proj = {f: rnd(sum(dims[m][1] for m in mods), dims[mods[0]][0]) for f, (_, mods) in FUSED.items()}
        return LayerWeights(
            torch.ones(cfg.hidden_size, device=DEV, dtype=DTYPE),
            torch.ones(cfg.hidden_size, device=DEV, dtype=DTYPE),
            proj,
        )

    embed = rnd(cfg.vocab_size, cfg.hidden_size)
    return ModelWeights(
        embed,
        rnd(cfg.vocab_size, cfg.hidden_size),
        torch.ones(cfg.hidden_size, device=DEV, dtype=DTYPE),
        [layer() for _ in range(cfg.num_layers)],
    )


def random_adapter(cfg: ModelConfig) -> LoraWeights:
    tensors = {
        (layer, m): (torch.randn(RANK, d_in) * 0.01, torch.randn(d_out, RANK) * 0.01)
        for layer in range(cfg.num_layers)
        for m, (d_in, d_out) in cfg.module_dims.items()
    }
    # the host cache's layout: one (pageable) buffer per adapter, in the serving dtype; the pool
    # stages it through its pinned buffers
    return pack(LoraWeights("proto", "v0", AdapterManifest(RANK, 32.0, False, None), tensors), dtype=DTYPE)


class Adapters:
    """The engine's adapter provider, pre-filled: every adapter is already in host memory,
    so the burst measures exactly the host→GPU tier."""

    def __init__(self, weights: dict[str, LoraWeights]):
        self.weights = weights

    def get(self, name):
        return self.weights[name]


def measure_h2d(cfg, proto) -> dict:
    nbytes = proto.nbytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    pinned = nbytes / statistics.median(times) / 1e9
    pool = LoraPool(cfg.shape, PoolConfig(12, RANK, DTYPE, DEV))
    loads = []
    for i in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slot = pool.acquire(dataclasses.replace(proto, name=f"h{i}", version=str(i)))
        while not pool.ready(slot):
            time.sleep(20e-6)  # yield: the copy is issued from the pool's copier thread
        loads.append(time.perf_counter() - t0)
    load_s = statistics.median(loads[2:])
    return {
        "adapter_bytes": nbytes,
        "host_dtype": str(DTYPE).removeprefix("torch."),
        "pinned_bw_GBps": round(pinned, 1),
        "h2d_GBps": round(nbytes / load_s / 1e9, 1),
        "load_ms": round(load_s * 1e3, 2),
        "raw_copy_ms": round(statistics.median(times) * 1e3, 2),
    }


def _prompt(rng, n=64):
    return tuple(rng.randrange(32000) for _ in range(n))


def burst(engine: EngineCore, names: list[str], rng, window_s=0.1):
    """Add one request per name over window_s while stepping: TTFT per request, and the time and
    tokens of each step that ran."""
    arrivals = {f"{n}-{rng.random()}": (n, i * window_s / len(names)) for i, n in enumerate(names)}
    pending = sorted(arrivals.items(), key=lambda kv: kv[1][1])
    t0, ttft, steps = time.perf_counter(), {}, []
    params = SamplingParams(max_tokens=8, temperature=0.0)
    while len(ttft) < len(arrivals):
        now = time.perf_counter() - t0
        while pending and pending[0][1][1] <= now:
            rid, (name, _) = pending.pop(0)
            engine.add(GenerateRequest(rid, _prompt(rng, 128), params, name))
        s, computed = time.perf_counter(), engine.tokens_computed
        chunks = engine.step()
        torch.cuda.synchronize()
        if not engine.idle:
            steps.append((time.perf_counter() - s, engine.tokens_computed - computed))
        for c in chunks:
            if c.request_id in arrivals and c.request_id not in ttft and getattr(c, "token_ids", ()):
                ttft[c.request_id] = time.perf_counter() - t0 - arrivals[c.request_id][1]
    for rid in arrivals:
        engine.abort(rid)
    return sorted(ttft.values()), steps


def pct(xs, q):
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    cfg = llama7b()
    proto = random_adapter(cfg)
    h2d = measure_h2d(cfg, proto)
    print(json.dumps(h2d), flush=True)
    names = [f"d{i}" for i in range(8)] + [f"b{i}" for i in range(64)]
    adapters = Adapters({n: dataclasses.replace(proto, name=n, version="1") for n in names})
    econf = EngineConfig(
        max_num_seqs=128,
        max_tokens_per_step=4096,
        num_kv_blocks=4096,
        block_size=16,
        max_loras=80,
        max_lora_rank=RANK,
        dtype=DTYPE,
        device=DEV,
    )
    pool = LoraPool(cfg.shape, PoolConfig(econf.max_loras, RANK, DTYPE, DEV))
    engine = EngineCore(LlamaModel(cfg, random_weights(cfg), pool), adapters, None, econf)
    rng = random.Random(0)
    for i in range(32):  # the 32 decoders: 8 adapters and the base model
        engine.add(
            GenerateRequest(
                f"dec{i}",
                _prompt(rng),
                SamplingParams(max_tokens=4000, temperature=0.0),
                names[i % 9] if i % 9 < 8 else None,
            )
        )
    for _ in range(5):
        engine.step()
    warm_steps = []
    for _ in range(30):
        s = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        warm_steps.append(time.perf_counter() - s)
    cold_ttft, cold_steps = burst(engine, names[8:], rng)
    warm_ttft, warm_burst_steps = burst(engine, names[8:], rng)  # same adapters, now resident
    ms = lambda x: round(x * 1e3, 2)  # noqa: E731
    result = {
        **h2d,
        "ttft_p50_ms": ms(pct(cold_ttft, 50)),
        "ttft_p99_ms": ms(pct(cold_ttft, 99)),
        "warm_ttft_p50_ms": ms(pct(warm_ttft, 50)),
        "warm_ttft_p99_ms": ms(pct(warm_ttft, 99)),
        "max_decode_step_ms_during_burst": ms(max(t for t, _ in cold_steps)),
        "max_step_ms_during_warm_burst": ms(max(t for t, _ in warm_burst_steps)),
        # a step that waited on a copy would stand out here: time per token it computed
        "max_us_per_token_during_burst": round(max(t / n for t, n in cold_steps) * 1e6, 1),
        "max_us_per_token_during_warm_burst": round(max(t / n for t, n in warm_burst_steps) * 1e6, 1),
        "warm_decode_step_ms": ms(statistics.median(warm_steps)),
        "gpu_loads": pool.loads,
    }
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": str(date.today()),
        "torch": torch.__version__,
        "model": "Llama-2-7B shape, random fp16 weights",
        "adapter": f"rank {RANK}, all 7 projections",
        "burst": "64 requests (prompt 128) for 64 GPU-non-resident, host-resident adapters over 100 ms; 32 decoding",
    }
    print(json.dumps(result, indent=1))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "adapter_load_h200.json").write_text(
        json.dumps(
            {
                "meta": meta,
                **result,
                "cold_ttft_s": cold_ttft,
                "warm_ttft_s": warm_ttft,
                "cold_steps_s_tokens": cold_steps,
                "warm_burst_steps_s_tokens": warm_burst_steps,
            },
            indent=1,
        )
    )
    plot(cold_ttft, warm_ttft, cold_steps, warm_burst_steps, a.out / "adapter_load_h200.png")


def plot(cold_ttft, warm_ttft, cold_steps, warm_steps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for xs, label in ((cold_ttft, "adapters cold (H2D on demand)"), (warm_ttft, "adapters resident")):
        ax1.plot([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax1.set_xlabel("time to first token (ms)")
    ax1.set_ylabel("fraction of burst requests")
    ax1.legend()
    ax2.plot([t * 1e3 for t, _ in cold_steps], "o-", label="cold burst")
    ax2.plot([t * 1e3 for t, _ in warm_steps], "o-", label="warm burst")
    ax2.set_xlabel("engine step")
    ax2.set_ylabel("step time (ms)")
    ax2.legend()
    fig.suptitle("64-adapter cold-start burst, Llama-2-7B shape, H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
