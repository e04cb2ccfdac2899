"""Build an engine from a base model (a checkpoint directory, .gguf file or s3://…; default: the embedded SmolLM2)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from adapters_store.gpu_pool import LoraPool, PoolConfig, slots_for_budget
from adapters_store.store import AdapterStore, StoreConfig, check_budgets
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.tp.sharding import shard_config
from app.model.config import ModelConfig
from app.model.llama import LlamaModel
from app.model.source import resolve_model
from app.model.weights import load_weights


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
    engine's) and loaded once now, so a bad one fails at start-up."""
    from transformers import AutoConfig

    path = resolve_model(model_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
    if store is None:
        store_config = replace(
            store_config, max_rank=config.max_lora_rank, host=replace(store_config.host, dtype=config.dtype)
        )
        check_budgets(cfg.shape, store_config)
        store = AdapterStore(cfg.shape, store_config)
    tp = config.tensor_parallel_size
    shape = cfg.shape if tp == 1 else shard_config(cfg, tp).shape  # a GPU's slots hold adapter shards
    slots = (
        config.max_loras
        if config.lora_memory_bytes is None
        else slots_for_budget(shape, config.max_lora_rank, config.dtype, config.lora_memory_bytes)
    )
    pool_config = PoolConfig(slots, config.max_lora_rank, config.dtype, config.device)
    on_load = lambda nbytes, s: store.metrics.load("gpu", nbytes, s)  # noqa: E731
    if tp > 1:  # one shard worker per GPU, driven from here (app/engine/tp/)
        from app.engine.tp.model import build_tp_model

        model = build_tp_model(path, config, pool_config, on_load)
    else:
        model = LlamaModel(
            cfg, load_weights(path, cfg, config.dtype, config.device), LoraPool(cfg.shape, pool_config, on_load)
        )
    for name, uri in (adapters or {}).items():
        store.register(name, uri)
        store.get(name)
    tok = load_tokenizer(path) if tokenizer == "auto" else tokenizer
    return EngineCore(model, store, tok, config)
