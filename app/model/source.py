"""Where the base model comes from (``model:`` in serve_config.yaml, ``--model`` of app.generate),
resolved on the node that loads it to a local HF checkpoint directory:

- nothing: the embedded default (app/model/default.py);
- a local HF checkpoint directory (config.json, one or sharded ``*.safetensors``): used in place;
- a local ``.gguf`` file: dequantized once per node into the cache (app/model/gguf.py);
- ``s3://bucket/prefix/``: copied once per node into the cache and verified
  (app/model/s3_checkpoint.py), so a Ray cluster's nodes need no shared filesystem.

Pickled weights (``*.bin``, ``*.pt``, …) are never loaded: a checkpoint with only those is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from app.model.default import default_model_dir
from app.model.node_cache import ModelSourceError, cache_root, fill_once, no_safetensors

_WHERE = "use a local HF checkpoint directory, a .gguf file, or s3://bucket/prefix/"


def resolve_model(model: str | os.PathLike | None, weights: bool = True) -> Path:
    """The local checkpoint directory for ``model``; weights=False when only its config and
    tokenizer are read (an S3 model's weights are then not downloaded)."""
    if model is None:
        return default_model_dir()
    text = os.fspath(model)
    if text.startswith("s3://"):
        from app.model.s3_checkpoint import fetch_checkpoint  # boto3 only when a model is in S3

        return fetch_checkpoint(text, weights)
    if "://" in text:
        raise ModelSourceError(f"unsupported model location {text!r}: {_WHERE}")
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"no HF checkpoint at {path} (no config.json): {_WHERE}")
    if weights and not any(path.glob("*.safetensors")):
        raise no_safetensors(str(path), [p.name for p in path.iterdir()])
    return path


def _from_gguf(gguf: Path) -> Path:
    """The dequantized checkpoint of a GGUF file, cached by its path, size and modification time."""
    from app.model.gguf import is_converted, write_checkpoint

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_root() / "gguf"
    return fill_once(root, root / f"{gguf.stem}-{key}", lambda tmp: write_checkpoint(gguf, tmp), is_converted)
