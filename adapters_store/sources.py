"""Where adapter files come from. A source resolves an adapter to a Snapshot (its
config bytes, what the weights object must be, and the version that names this
exact content), then reads the weights for that snapshot and nothing else.

- LocalSource: a PEFT directory; version from the files' sha256.
- S3Source (adapters_store/s3_source.py): ``s3://bucket/prefix/name/``; version
  from the objects' ETag / VersionId, weights through the verified disk cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from adapters_store.disk_cache import ObjectInfo
from adapters_store.errors import AdapterNotFoundError, InvalidAdapterError, SourceChangedError
from adapters_store.peft_weights import WEIGHTS_FILE

CONFIG_FILE = "adapter_config.json"
BIN_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB; anything huge is not one


@dataclass(frozen=True)
class Snapshot:
    uri: str
    config: bytes
    weights: ObjectInfo
    version: str  # 16 hex digits naming this exact config + weights


class Source(Protocol):
    uri: str

    def snapshot(self) -> Snapshot: ...

    def read_weights(self, snap: Snapshot) -> tuple[bytes, str]:
        """(safetensors bytes, tier that served them: "local", "disk" or "s3")."""

    # optional: read_into(snap, buffer) -> (the file in buffer(nbytes), tier), see read_staged


class Staging(threading.local):
    """Per loader thread, the buffer a weights file is read into, reused by that thread's next
    load: a fresh 80 MB bytes object per load costs its page faults every time, and building it
    (bytes.join, a read of the whole file) holds the GIL for the whole copy."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


def read_staged(source: Source, snap: Snapshot, staging: Staging) -> tuple[np.ndarray, str]:
    """The weights file in this thread's staging buffer (valid until its next load)."""
    read_into = getattr(source, "read_into", None)
    if read_into is not None:
        return read_into(snap, staging.get)
    blob, tier = source.read_weights(snap)
    buf = staging.get(len(blob))
    np.copyto(buf, np.frombuffer(blob, np.uint8))  # numpy releases the GIL for a large copy
    return buf, tier


def version_of(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def b64_to_hex(value: str | None) -> str | None:
    """An S3 checksum header (base64) as hex; None when absent or malformed."""
    if not value:
        return None
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError):
        return None


def missing_weights(where: str, has_bin: bool) -> InvalidAdapterError:
    hint = f" (pickled {BIN_FILE} is never loaded: convert it to safetensors)" if has_bin else ""
    return InvalidAdapterError(f"missing {WEIGHTS_FILE} in adapter {where}{hint}")


def check_config_size(size: int, where: str) -> None:
    if size > MAX_CONFIG_BYTES:
        raise InvalidAdapterError(f"{CONFIG_FILE} of {where} is {size} bytes; a PEFT config is a few KB")


def _sha256_file(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class LocalSource:
    """A PEFT directory on this machine, read in place (nothing to download or cache)."""

    def __init__(self, path: Path):
        self.path = path
        self.uri = str(path)

    def snapshot(self) -> Snapshot:
        if not self.path.is_dir():
            raise AdapterNotFoundError(f"adapter directory {self.path} does not exist")
        config_path, weights = self.path / CONFIG_FILE, self.path / WEIGHTS_FILE
        if not config_path.is_file():
            raise InvalidAdapterError(f"missing {CONFIG_FILE} in {self.path.name}")
        check_config_size(config_path.stat().st_size, self.uri)
        if not weights.is_file():
            raise missing_weights(self.path.name, (self.path / BIN_FILE).exists())
        config = config_path.read_bytes()
        size, sha = _sha256_file(weights)
        version = version_of("local", hashlib.sha256(config).hexdigest(), sha)
        return Snapshot(self.uri, config, ObjectInfo(size, sha256=sha), version)

    def read_weights(self, snap: Snapshot) -> tuple[bytes, str]:
        blob = (self.path / WEIGHTS_FILE).read_bytes()
        if hashlib.sha256(blob).hexdigest() != snap.weights.sha256:
            raise SourceChangedError(f"{self.uri}/{WEIGHTS_FILE} changed while loading; retry")
        return blob, "local"

    def read_into(self, snap: Snapshot, buffer: Callable[[int], np.ndarray]) -> tuple[np.ndarray, str]:
        """The same bytes and check, read into a reused buffer (readinto and sha256 release the GIL)."""
        with open(self.path / WEIGHTS_FILE, "rb", buffering=0) as f:
            buf = buffer(os.fstat(f.fileno()).st_size)
            view, done = memoryview(buf), 0
            while done < buf.nbytes and (n := f.readinto(view[done:])):
                done += n
        if done != snap.weights.size or hashlib.sha256(buf).hexdigest() != snap.weights.sha256:
            raise SourceChangedError(f"{self.uri}/{WEIGHTS_FILE} changed while loading; retry")
        return buf, "local"


def local_adapters(root: Path) -> dict[str, str]:
    """Every PEFT directory directly under root, by directory name."""
    if not root.is_dir():
        return {}
    return {d.name: str(d) for d in sorted(root.iterdir()) if (d / CONFIG_FILE).is_file()}
