"""The diurnal trace on real GPU replicas: several LoraReplica replicas share one GPU
(fractional num_gpus), each with the real engine (paged KV, SGMV, CUDA graphs) on a small
random-weight Llama, under loraplex's consolidating router and autoscaling policy. It
shows the autoscaler and migration working on GPU replicas; the replica-seconds
comparison against Ray Serve's defaults is the CPU run (benchmarks/diurnal_trace.py).

    python -m benchmarks.diurnal_trace_gpu --out results.json     # on the GPU machine

A peak of 16 requests/s of 256 new tokens against 4 replicas of batch 4 outran a 225 s run
on the H200 (no JSON); the defaults ask for 8 requests/s of 64 tokens at batch 8, which a
45 s trace completes in ~2 minutes (results/diurnal_trace_gpu_h200.json).

The model has SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads) with
random bf16 weights and no tokenizer (token ids in, token ids out); 100 adapter names,
Zipf(1.5) popular, map onto 8 random rank-16 PEFT adapters on all seven projections.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import pathlib
import tempfile

from benchmarks.diurnal_trace import ADAPTERS, ZIPF, run_policy, trace

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_BATCH, REPLICAS, NEW_TOKENS, DISTINCT = 8, 4, 64, 8
DELAYS = {"upscale_delay_s": 1.0, "downscale_delay_s": 5.0}


def make_model(root: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A random SmolLM2-shaped checkpoint and ADAPTERS adapter names → DISTINCT directories."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.checkpoints import make_random_adapter

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model_dir = root / "model"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    dirs = [make_random_adapter(model_dir, root / f"adapter-{k}", 16, MODULES, seed=k) for k in range(DISTINCT)]
    return model_dir, {f"adapter-{i}": str(dirs[i % DISTINCT]) for i in range(ADAPTERS)}


def gpu_engine(model_dir: str, adapters: dict[str, str], settings):
    """An engine_factory for LoraReplica: the real engine, no tokenizer."""
    from app.engine.async_engine import AsyncEngine
    from app.engine.factory import build_engine

    return AsyncEngine(build_engine(model_dir, settings.core_config, adapters, tokenizer=None))


def gpu_replica(model_dir: pathlib.Path, adapters: dict[str, str]):
    from app.serving.config import parse_args
    from app.serving.replica import LoraReplica, ReplicaSettings

    autoscaling = {
        "min_replicas": 1,
        "initial_replicas": REPLICAS,
        "max_replicas": REPLICAS,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        **DELAYS,
    }
    args = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "device": "cuda",
        "max_batch_size": MAX_BATCH,
        "num_kv_blocks": 1024,
        "max_loras": 16,
        "max_model_len": 1024,
        "replica": {
            "autoscaling_config": autoscaling,
            "max_ongoing_requests": MAX_BATCH,
            "ray_actor_options": {"num_gpus": 1 / REPLICAS, "num_cpus": 1},
        },
    }
    s = parse_args(args, "random-smollm2")
    settings = ReplicaSettings(str(model_dir), s.engine, (), migrate_locally=False)
    return LoraReplica.options(**s.replica_options).bind(
        settings, None, functools.partial(gpu_engine, str(model_dir), adapters)
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--peak-rps", type=float, default=8.0)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    a = ap.parse_args()
    import ray
    import torch

    root = pathlib.Path(tempfile.mkdtemp())
    model_dir, adapters = make_model(root)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    from ray import serve

    serve.start()
    arrivals = trace(a.duration, a.peak_rps, seed=13)
    print(f"loraplex on {REPLICAS} GPU replicas: {len(arrivals)} requests over {a.duration:g} s", flush=True)
    result = asyncio.run(
        run_policy(
            "loraplex", arrivals, gpu_replica(model_dir, adapters), MAX_BATCH, NEW_TOKENS, vocab=49152, step=None
        )
    )
    serve.shutdown()
    ray.shutdown()
    out = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "model": "SmolLM2-135M shape, random bf16 weights, no tokenizer",
        "replicas_per_gpu": REPLICAS,
        "num_gpus_per_replica": 1 / REPLICAS,
        "max_batch": MAX_BATCH,
        "new_tokens": NEW_TOKENS,
        "adapters": ADAPTERS,
        "distinct_adapter_weights": DISTINCT,
        "zipf": ZIPF,
        "delays": DELAYS,
        "duration_s": a.duration,
        "peak_rps": a.peak_rps,
        "loraplex": result,
    }
    a.out.write_text(json.dumps(out, indent=1))
    print({k: v for k, v in result.items() if k != "timeline"})


if __name__ == "__main__":
    main()
