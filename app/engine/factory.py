"""Build an engine from a base model (a checkpoint directory, .gguf file or s3://…; default: the embedded SmolLM2).

On CUDA the start-up goes: checks (GPU architecture, checkpoint against its config) → weights →
adapter slots and start-up adapters → a probe engine measures the workspace (app/engine/kv_probe.py)
→ the KV cache is sized (app/engine/kv_sizing.py) → the engine allocates it and captures its graphs.
A failure in any of them is one StartupError line (app/engine/startup.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from adapters_store.gpu_pool import LoraPool, PoolConfig, slots_for_budget
from adapters_store.store import AdapterStore
from adapters_store.store_config import StoreConfig, check_budgets
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.kv_sizing import KvPlan, kv_block_bytes, plan_kv
from app.engine.scheduler import blocks_for
from app.engine.startup import check_checkpoint, check_gpu, describe_device, stage
from app.engine.tp.sharding import shard_config
from app.model.config import ModelConfig
from app.model.llama import LlamaModel
from app.model.source import resolve_model
from app.model.weights import load_weights

# Serve sends this logger's records to the replica's log (its actors configure it; app.* loggers
# reach no handler there); outside Serve it is an ordinary logger.
log = logging.getLogger("ray.serve")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_engine(
    model_path: str | Path | None = None,
    config: EngineConfig = EngineConfig(),
    adapters: dict[str, str] | None = None,
    tokenizer="auto",
    store: AdapterStore | None = None,
    store_config: StoreConfig = StoreConfig(),
) -> EngineCore:
    """An EngineCore for a checkpoint of a supported family (app/model/family.py; found by
    app/model/source.py). ``adapters`` (name → local directory or s3:// URI) are registered in
    ``store`` (default: a new AdapterStore made from ``store_config``, its rank and dtype the
    engine's) and loaded once now, so a bad one fails at start-up. ``config.num_kv_blocks`` None:
    as many as fit (CUDA)."""
    from transformers import AutoConfig

    seconds: dict[str, float] = {}
    path = resolve_model(model_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)), config.quantization)
    check_gpu(config.device)
    check_checkpoint(path, cfg)
    if store is None:
        store_config = replace(
            store_config, max_rank=config.max_lora_rank, host=replace(store_config.host, dtype=config.dtype)
        )
        check_budgets(cfg.shape, store_config)
        store = AdapterStore(cfg.shape, store_config)
    model = _load_model(path, cfg, config, store, seconds)
    start = time.perf_counter()
    with stage("adapters", config.device):
        for name, uri in (adapters or {}).items():
            store.register(name, uri)
            store.get(name)
    seconds["adapters"] = time.perf_counter() - start
    tok = load_tokenizer(path) if tokenizer == "auto" else tokenizer
    return build_core(model, store, tok, config, seconds)


def _load_model(path: Path, cfg: ModelConfig, config: EngineConfig, store: AdapterStore, seconds: dict):
    tp = config.tensor_parallel_size
    shape = cfg.shape if tp == 1 else shard_config(cfg, tp).shape  # a GPU's slots hold adapter shards
    slots = (
        config.max_loras
        if config.lora_memory_bytes is None
        else slots_for_budget(shape, config.max_lora_rank, config.dtype, config.lora_memory_bytes)
    )
    pool_config = PoolConfig(slots, config.max_lora_rank, config.dtype, config.device)
    on_load = lambda nbytes, s: store.metrics.load("gpu", nbytes, s)  # noqa: E731
    start = time.perf_counter()
    if tp > 1:  # one shard worker per GPU, driven from here (app/engine/tp/)
        from app.engine.tp.model import build_tp_model

        with stage("weights", config.device):
            model = build_tp_model(path, config, pool_config, on_load)
        seconds["weights"] = time.perf_counter() - start
        return model
    with stage("weights", config.device):
        weights = load_weights(path, cfg, config.dtype, config.device)
    seconds["weights"] = time.perf_counter() - start
    with stage("adapters", config.device):
        return LlamaModel(cfg, weights, LoraPool(cfg.shape, pool_config, on_load))


def build_core(model, store, tokenizer, config: EngineConfig, seconds: dict | None = None) -> EngineCore:
    """The engine over a loaded model: its KV sized (auto) or checked (explicit) on a GPU, then allocated."""
    seconds = {} if seconds is None else seconds
    start = time.perf_counter()
    plan = plan_for(model, store, tokenizer, config)
    seconds["kv_sizing"] = time.perf_counter() - start
    config = replace(config, num_kv_blocks=plan.blocks)
    log.info("%s on %s", plan.describe(), describe_device(config.device))
    start = time.perf_counter()
    with stage("kv", config.device):
        core = EngineCore(model, store, tokenizer, config)
    graphs = core.runner.graphs
    seconds["graph_capture"] = graphs.capture_seconds if graphs is not None else 0.0
    seconds["kv_and_warm_up"] = time.perf_counter() - start - seconds["graph_capture"]
    core.startup_report.update(kv_cache=plan.as_dict(), startup_seconds={k: round(v, 3) for k, v in seconds.items()})
    return core


def plan_for(model, store, tokenizer, config: EngineConfig) -> KvPlan:
    """The KV plan: on one GPU measured by a probe engine (auto, or an explicit number checked);
    elsewhere the explicit number as given."""
    c = model.cfg  # a tensor-parallel model's is its shard's: KV heads per GPU
    block_bytes = kv_block_bytes(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, config.dtype.itemsize)
    if torch.device(config.device).type != "cuda" or config.tensor_parallel_size > 1:
        return KvPlan(config.num_kv_blocks, config.block_size, block_bytes, "explicit")
    from app.engine.kv_probe import measure

    max_model_len = config.max_model_len or c.max_position_embeddings
    with stage("kv", config.device):
        m = measure(model, store, tokenizer, config, max_model_len)
    return plan_kv(
        config.num_kv_blocks,
        total=m.total,
        used=m.used,
        workspace=m.workspace,
        utilization=config.gpu_memory_utilization,
        block_bytes=block_bytes,
        block_size=config.block_size,
        min_blocks=blocks_for(max_model_len, config.block_size),
    )
