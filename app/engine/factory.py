"""Build an engine from a checkpoint directory (default: the embedded SmolLM2)."""
from __future__ import annotations

from pathlib import Path

from adapters_store.gpu_pool import LoraPool, PoolConfig
from app.engine.adapters import LocalAdapters
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.model.config import ModelConfig
from app.model.default import default_model_dir
from app.model.llama import LlamaModel
from app.model.weights import load_weights


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_engine(model_path: str | Path | None = None, config: EngineConfig = EngineConfig(),
                 adapters: dict[str, str] | None = None, tokenizer="auto") -> EngineCore:
    """An EngineCore for a local HF Llama-family checkpoint, with adapters registered by name."""
    from transformers import AutoConfig

    path = Path(model_path) if model_path else default_model_dir()
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
    weights = load_weights(path, cfg, config.dtype, config.device)
    pool = LoraPool(cfg.shape, PoolConfig(config.max_loras, config.max_lora_rank, config.dtype, config.device))
    registry = LocalAdapters(cfg.shape, config.max_lora_rank)
    for name, adapter_path in (adapters or {}).items():
        registry.register(name, adapter_path)
    tok = load_tokenizer(path) if tokenizer == "auto" else tokenizer
    return EngineCore(LlamaModel(cfg, weights, pool), registry, tok, config)
