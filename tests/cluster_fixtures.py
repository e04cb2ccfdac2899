"""Helpers for the cluster tests and benchmarks: a tiny random Llama that speaks the
embedded model's tokenizer (real text, stop strings, chat template), engines slowed to
a fixed step time, and direct access to each LoraReplica replica."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

STEP_DELAY_S = 0.03  # the slowed engine's extra time per step: requests stay in flight long enough to observe


def make_tiny_chat_llama(path: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.model.default import default_model_dir

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
        initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def slowed_engine(settings):
    """The real engine, each step STEP_DELAY_S slower (a GPU-sized step on a tiny CPU model)."""
    from app.replica import build_async_engine

    engine = build_async_engine(settings)
    step = engine.core.step

    def slow_step():
        time.sleep(STEP_DELAY_S)
        return step()

    engine.core.step = slow_step
    return engine


def replica_ids(app: str) -> list[str]:
    """Ids of the LoraReplica actors alive now."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LoraReplica#"
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if isinstance(a, dict) and a["name"].startswith(prefix))


def replica_actor(app: str, replica_id: str):
    import ray

    return ray.get_actor(f"SERVE_REPLICA::{app}#LoraReplica#{replica_id}", namespace="serve")


def replica_report(app: str, replica_id: str):
    """The replica's routing stats, read from it directly (not the router's stale copy)."""
    import ray

    from cluster.stats import ReplicaStats

    return ReplicaStats.from_dict(ray.get(replica_actor(app, replica_id).record_routing_stats.remote(), timeout=30))
