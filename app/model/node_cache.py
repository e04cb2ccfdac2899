"""The node-local cache of base checkpoints (an S3 copy, a dequantized GGUF): its root, and
``fill_once``, which publishes an entry only when it is complete.

An entry is filled in a hidden temp directory beside it, fsynced, and renamed into place,
so that a reader only ever sees a complete entry (also after a crash mid-fill). An exclusive
lock per entry (``flock``, released by the kernel if the holder dies) makes the processes of
one node — several replicas, the ingress — fill it once: the others wait, then reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from adapters_store.disk_cache import fsync_path
from adapters_store.errors import LoraplexError
from adapters_store.paths import make_dirs

_PARTIAL = ".partial"


class ModelSourceError(LoraplexError):
    """The base model cannot be had from where ``model`` points: nothing there, a format that
    is refused (pickles), an S3 failure, or a file that failed verification."""


def cache_root() -> Path:
    """``LORAPLEX_CACHE`` (default ~/.cache/loraplex): converted and downloaded checkpoints."""
    return Path(os.environ.get("LORAPLEX_CACHE", Path.home() / ".cache" / "loraplex")).expanduser()


def fill_once(root: Path, entry: Path, fill: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """entry (a directory below root), made by ``fill(tmp_dir)`` unless ``complete(entry)`` holds.

    An entry that exists but is not complete (a file lost or truncated on disk) is removed and
    filled again. A fill that raises leaves nothing behind.
    """
    root.mkdir(parents=True, exist_ok=True)
    parent = make_dirs(root.resolve(), root.resolve() / entry.relative_to(root).parent)  # never through a symlink
    entry = parent / entry.name
    with open(parent / f".{entry.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir() and complete(entry):
            return entry
        shutil.rmtree(entry, ignore_errors=True)
        for stale in parent.glob(f".{entry.name}.*{_PARTIAL}"):  # we hold the lock: their filler is dead
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{entry.name}.", suffix=_PARTIAL))
        try:
            fill(tmp)
            for f in tmp.iterdir():  # the rename must never publish bytes not yet on disk
                fsync_path(f)
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(parent)
    return entry


PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def no_safetensors(where: str, names) -> ModelSourceError:
    """The refusal of a checkpoint without safetensors weights, naming a pickle it holds instead."""
    pickles = sorted(name for name in names if name.endswith(PICKLES))
    why = f"; {pickles[0]} is a PyTorch pickle, which is never loaded: convert it to safetensors" if pickles else ""
    return ModelSourceError(f"no *.safetensors weights at {where}{why}")
