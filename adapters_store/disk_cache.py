"""Verified local copies of S3 objects: ``fill`` downloads into a hidden temp file in
the target directory, verifies size and every checksum the object carries
(ETag MD5 for single-part uploads, SHA-256 / CRC32 from S3's checksum headers or
``x-amz-meta-sha256``), fsyncs, and renames it into place. A reader only ever opens
final names, so a partial or corrupt download is never served, also after a crash
mid-download; stale temp files are removed at start. Total size is bounded by an
LRU over the files this process knows (shared roots are best effort).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from adapters_store.errors import SourceResponseError
from adapters_store.paths import make_dirs

log = logging.getLogger("loraplex.adapters")
_PARTIAL = ".partial"


def _default_root() -> Path:
    return Path(os.environ.get("LORAPLEX_ADAPTER_CACHE", "~/.cache/loraplex/adapters")).expanduser()


@dataclass(frozen=True)
class DiskCacheConfig:
    root: Path = field(default_factory=_default_root)
    budget_bytes: int = 64 << 30
    stale_partial_s: float = 3600.0  # older temp files belong to a dead download (live ones grow)


@dataclass(frozen=True)
class ObjectInfo:
    """What a downloaded object must be; every digest present is verified (hex strings)."""

    size: int
    etag: str | None = None
    version_id: str | None = None
    md5: str | None = None
    sha256: str | None = None
    crc32: str | None = None


class VerifyingSink:
    """A file writer that keeps the bytes and hashes them on the way (no second pass)."""

    def __init__(self, file: BinaryIO, info: ObjectInfo, what: str):
        self.file, self.info, self.what = file, info, what
        self.parts: list[bytes] = []
        self.size = 0
        self.md5 = hashlib.md5(usedforsecurity=False) if info.md5 else None
        self.sha256 = hashlib.sha256() if info.sha256 else None
        self.crc32 = 0

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.parts.append(bytes(chunk))
        self.size += len(chunk)
        if self.size > self.info.size:
            raise self._bad(f"got more than the expected {self.info.size} bytes")
        for digest in (self.md5, self.sha256):
            if digest:
                digest.update(chunk)
        if self.info.crc32:
            self.crc32 = zlib.crc32(chunk, self.crc32)

    def finish(self) -> bytes:
        if self.size != self.info.size:
            raise self._bad(f"got {self.size} of {self.info.size} bytes (truncated)")
        checks = [
            ("MD5", self.md5 and self.md5.hexdigest(), self.info.md5),
            ("SHA-256", self.sha256 and self.sha256.hexdigest(), self.info.sha256),
            ("CRC32", self.info.crc32 and f"{self.crc32:08x}", self.info.crc32),
        ]
        for algo, got, want in checks:
            if want and got != want:
                raise self._bad(f"{algo} mismatch (got {got}, expected {want})")
        return b"".join(self.parts)

    def _bad(self, why: str) -> SourceResponseError:
        return SourceResponseError(f"download of {self.what} failed verification: {why}; discarded")


class DiskCache:
    def __init__(self, config: DiskCacheConfig, on_evict: Callable[[Path], None] = lambda path: None):
        self.config = config
        config.root.mkdir(parents=True, exist_ok=True)
        self.root = config.root.resolve()
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # LRU, oldest first
        self.nbytes = 0
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def read(self, path: Path, info: ObjectInfo) -> bytes | None:
        """The cached object, or None (absent, or not what it must be: then it is removed)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:  # ELOOP: a symlink was planted at a final name; never follow it
            self._remove(path)
            return None
        with os.fdopen(fd, "rb") as f:
            blob = f.read()
        if len(blob) != info.size:
            log.warning("cached %s has %d bytes, expected %d: removed", path, len(blob), info.size)
            self._remove(path)
            return None
        with self._lock:
            self._track(path, len(blob))
        return blob

    def fill(self, path: Path, info: ObjectInfo, download: Callable[[VerifyingSink], None]) -> bytes:
        """download(sink) writes the object into sink; verified bytes are renamed into place."""
        directory = make_dirs(self.root, path.parent)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=_PARTIAL)
        try:
            with os.fdopen(fd, "wb") as f:
                sink = VerifyingSink(f, info, str(path.relative_to(self.root)))
                download(sink)
                blob = sink.finish()
                f.flush()
                os.fsync(f.fileno())  # the rename must never expose bytes not yet on disk
            os.replace(tmp, path)
        except BaseException:
            _unlink(Path(tmp))
            raise
        fsync_path(directory)
        with self._lock:
            self._track(path, len(blob))
        self._prune(keep=path)
        return blob

    def _scan(self) -> None:
        """Index cached files (oldest first) and delete temp files of dead downloads."""
        found, cutoff = [], time.time() - self.config.stale_partial_s
        for dirpath, _, filenames in os.walk(self.root):  # never follows symlinked directories
            for name in filenames:
                p = Path(dirpath) / name
                st = os.lstat(p)
                if name.startswith(".") and name.endswith(_PARTIAL):
                    if st.st_mtime < cutoff:
                        _unlink(p)
                elif not name.startswith("."):
                    found.append((st.st_mtime, p, st.st_size))
        for _, p, size in sorted(found):
            self._track(p, size)

    def _track(self, path: Path, size: int) -> None:
        """Record path as the most recently used file (caller holds the lock, or is __init__)."""
        self.nbytes += size - self._files.pop(path, 0)
        self._files[path] = size

    def _prune(self, keep: Path) -> None:
        while True:
            with self._lock:
                if self.nbytes <= self.config.budget_bytes:
                    return
                victim = next((p for p in self._files if p != keep), None)
                if victim is None:
                    return
                self.nbytes -= self._files.pop(victim)
            _unlink(victim)
            _rmdir_quiet(victim.parent)
            self._on_evict(victim)

    def _remove(self, path: Path) -> None:
        with self._lock:
            self.nbytes -= self._files.pop(path, 0)
        _unlink(path)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir_quiet(directory: Path) -> None:
    try:
        directory.rmdir()  # the emptied @version directory; fails harmlessly if not empty
    except OSError:
        pass


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
