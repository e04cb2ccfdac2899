"""Adapter names, source URIs and cache paths, validated so that no name or key can
leave the cache root or alias another adapter's files.

Cache layout: ``<root>/s3/<bucket>/<key segments...>/@<version>/<file>``. The
bucket and every key segment stay separate directory levels (no flattening
like ``a--b``, which would let ``a--b/c`` and ``a/b--c`` collide), and ``@`` is
not allowed in segments, so a version directory can never be some other
adapter's prefix.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from adapters_store.errors import AdapterUriError, UnsafePathError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Leading "." is refused: no ".", "..", or names that look like our hidden temp files.
_SEGMENT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}$")
_VERSION = re.compile(r"^[0-9a-f]{16,64}$")


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    segments: tuple[str, ...]  # the adapter's prefix, split on "/"

    def key(self, filename: str) -> str:
        return "/".join((*self.segments, filename))

    @property
    def prefix(self) -> str:
        """The listing prefix: always ends in "/", so "lora1" never matches "lora10/…"."""
        return "".join(s + "/" for s in self.segments)

    def child(self, name: str) -> S3Uri:
        return S3Uri(self.bucket, (*self.segments, check_name(name)))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise UnsafePathError(f"invalid adapter name {name!r}: use letters, digits, '.', '_', '-' (max 128)")
    return name


def parse_uri(uri: str | os.PathLike) -> S3Uri | Path:
    """``s3://bucket/prefix/name/`` → S3Uri; a local directory (path or file://) → its absolute Path."""
    if isinstance(uri, os.PathLike):
        return Path(uri).expanduser().absolute()
    if "://" not in uri:
        return Path(uri).expanduser().absolute()
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return Path(rest).absolute()
    if scheme != "s3":
        raise AdapterUriError(f"unsupported adapter URI scheme {scheme!r} (use s3:// or a local path)")
    if "%" in rest:
        raise UnsafePathError(f"URL-encoded characters are not allowed in adapter URIs: {uri!r}")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UnsafePathError(f"invalid S3 bucket name {bucket!r}")
    segments = tuple(key.removesuffix("/").split("/")) if key.strip("/") else ()
    for seg in segments:
        if not _SEGMENT.match(seg):
            raise UnsafePathError(f"unsafe S3 key segment {seg!r} in {uri!r} (allowed: [A-Za-z0-9._-], no '.'/'..')")
    return S3Uri(bucket, segments)


def cache_dir(root: Path, uri: S3Uri, version: str) -> Path:
    """The cache directory of one version of uri's objects (pure: creates nothing)."""
    if not _VERSION.match(version):
        raise UnsafePathError(f"invalid version {version!r}")
    return root.joinpath("s3", uri.bucket, *uri.segments, f"@{version}")


def cache_file(root: Path, uri: S3Uri, version: str, filename: str) -> Path:
    """Where a verified object lives in the cache (pure: creates nothing)."""
    if not _SEGMENT.match(filename):
        raise UnsafePathError(f"unsafe file name {filename!r}")
    return cache_dir(root, uri, version) / filename


def make_dirs(root: Path, directory: Path) -> Path:
    """mkdir -p below root, refusing any existing component that is not a real directory.

    Checked level by level before descending, so a planted symlink can never make
    us create or write anything outside the root (Path.mkdir would follow it).
    """
    current = root
    for part in directory.relative_to(root).parts:
        current = current / part
        try:
            os.mkdir(current, 0o755)
        except FileExistsError:
            pass
        if not stat.S_ISDIR(os.lstat(current).st_mode):
            raise UnsafePathError(f"cache path component {current} is not a directory (symlink?)")
    return current
