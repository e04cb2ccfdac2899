"""A base checkpoint in S3 (``model: s3://bucket/prefix/``), copied once per node into the
node-local cache, so that a Ray cluster's nodes need no shared filesystem.

What is copied: the files directly under the prefix that an HF checkpoint is read from and
that hold no code or pickles — ``*.safetensors``, ``*.json``, tokenizer files (``*.model``,
``*.txt``, ``*.tiktoken``, ``*.jinja``). A prefix with PyTorch pickles but no safetensors is
refused. One ListObjectsV2 names the files with their size and ETag; their hash names the cache
entry ``<cache>/models/s3/<bucket>/<prefix…>/@<version>/``. An entry that exists (every file
at its listed size) is used with no further request; otherwise each file is fetched by
parallel ranged GETs pinned to the listed ETag, written in place, verified, and the entry is
published by an atomic rename (app/model/node_cache.py).

Verification (docs/models_source.md): the size always; the SHA-256 from a ``SHA256SUMS``
manifest in the prefix (``sha256sum``'s format), from S3's full-object ChecksumSHA256 or from
``x-amz-meta-sha256``; the ETag, which is the object's MD5 for a single-part upload and the MD5
of its parts' MD5s for a multipart one (checked when the parts are of one size, as every
common uploader makes them; ranges then follow the parts). SSE-KMS/SSE-C ETags are no MD5.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from adapters_store.disk_cache import ObjectInfo
from adapters_store.errors import AdapterError
from adapters_store.metrics import Progress
from adapters_store.paths import S3Uri, cache_dir, parse_uri
from adapters_store.s3_source import (
    S3Config,
    client_errors,
    etag_is_md5,
    fetch_error,
    list_under,
    make_client,
    object_info,
    version_pin,
)
from adapters_store.sources import version_of
from app.model.node_cache import ModelSourceError, cache_root, fill_once, no_safetensors

log = logging.getLogger("loraplex.model")

CHECKPOINT_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*\.(safetensors|json|model|txt|tiktoken|jinja)$")
MANIFEST = "SHA256SUMS"
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](?:\./)?(\S+)$")
_MULTIPART_ETAG = re.compile(r"^([0-9a-f]{32})-(\d+)$")


@dataclass(frozen=True)
class S3ModelConfig:
    s3: S3Config = S3Config()  # boto3's credential/endpoint chain, timeouts, retries
    range_bytes: int = 64 << 20  # ranged GET size of single-part objects (multipart ones: one GET per part)
    workers: int = 16  # concurrent ranged GETs (at most s3.max_pool_connections)
    root: Path | None = None  # None: $LORAPLEX_CACHE/models


@dataclass(frozen=True)
class _Object:
    name: str
    size: int
    etag: str


@dataclass
class _Plan:
    """How one object is fetched and what it must be."""

    obj: _Object
    what: str  # s3://bucket/key, for messages
    pin: dict  # GetObject arguments that read exactly the listed version
    ranges: list[tuple[int, int]]  # [start, end) byte ranges, one GET each
    info: ObjectInfo  # size, and the whole-object MD5 / SHA-256 when known
    parts_md5: str | None = None  # a multipart ETag's MD5 of part MD5s, when ranges are its parts
    part_digests: list[bytes] = field(default_factory=list)


def fetch_checkpoint(uri: str, weights: bool = True, cfg: S3ModelConfig = S3ModelConfig()) -> Path:
    """The node-local copy of the checkpoint at uri, downloaded and verified if not cached yet.
    weights=False: config and tokenizer files only (what the ingress reads)."""
    loc = parse_uri(uri)
    client = make_client(cfg.s3)
    objects, manifest = _list_checkpoint(client, loc, weights)
    version = version_of(*(f"{o.name}:{o.size}:{o.etag}" for o in [*objects, *manifest]))
    root = cfg.root or cache_root() / "models"
    fill = lambda tmp: _download(client, loc, objects, manifest, tmp, cfg)  # noqa: E731
    complete = lambda entry: all(_size_or_none(entry / o.name) == o.size for o in objects)  # noqa: E731
    return fill_once(root, cache_dir(root, loc, version), fill, complete)


def _list_checkpoint(client, loc: S3Uri, weights: bool) -> tuple[list[_Object], list[_Object]]:
    """(checkpoint files to copy, [the SHA256SUMS manifest] or []), refusing what is no checkpoint."""
    try:
        listed = {item["Key"][len(loc.prefix) :]: item for item in list_under(client, loc, "Contents")}
    except AdapterError as exc:
        raise ModelSourceError(f"model {loc}: {exc}") from None
    files = {
        name: _Object(name, item["Size"], item["ETag"].strip('"'))
        for name, item in listed.items()
        if CHECKPOINT_FILE.match(name) or name == MANIFEST
    }
    if "config.json" not in files:
        raise ModelSourceError(f"no HF checkpoint at {loc}: config.json not found (objects there: {len(listed)})")
    if not any(name.endswith(".safetensors") for name in files):
        raise no_safetensors(str(loc), listed)
    manifest = [files.pop(MANIFEST)] if MANIFEST in files else []
    keep = [o for name, o in sorted(files.items()) if weights or not name.endswith(".safetensors")]
    return keep, manifest


def _download(
    client, loc: S3Uri, objects: list[_Object], manifest: list[_Object], tmp: Path, cfg: S3ModelConfig
) -> None:
    start, total = time.monotonic(), sum(o.size for o in objects)
    log.info("downloading model %s: %d files, %.1f MB", loc, len(objects), total / 1e6)
    sums = _read_manifest(client, loc, manifest[0]) if manifest else {}
    progress, lock = Progress(str(loc), total, cfg.s3.progress_every_s), threading.Lock()

    def get(plan: _Plan, fd: int, rng: tuple[int, int]) -> bytes:
        digest = _get_range(client, loc, plan, fd, rng, cfg.s3.chunk_bytes)
        with lock:
            progress.update(rng[1] - rng[0])
        return digest

    with ThreadPoolExecutor(cfg.workers, thread_name_prefix="model-s3") as pool:
        plans = list(pool.map(lambda o: _plan(client, loc, o, sums.get(o.name), cfg), objects))
        fds = []
        try:
            fds.extend(_create(tmp / p.obj.name, p.obj.size) for p in plans)
            futures = [[pool.submit(get, p, fd, r) for r in p.ranges] for p, fd in zip(plans, fds)]
            for plan, fs in zip(plans, futures):
                plan.part_digests = [f.result() for f in fs]
        except BaseException:
            pool.shutdown(cancel_futures=True)  # drop the GETs not started; wait for those running
            raise
        finally:
            for fd in fds:
                os.close(fd)
        list(pool.map(lambda p: _verify(p, tmp / p.obj.name), plans))
    seconds = time.monotonic() - start
    log.info(
        "model %s: %.1f MB downloaded and verified in %.1f s (%.0f MB/s)",
        loc,
        total / 1e6,
        seconds,
        total / 1e6 / max(seconds, 1e-9),
    )


def _plan(client, loc: S3Uri, obj: _Object, manifest_sha256: str | None, cfg: S3ModelConfig) -> _Plan:
    what = f"s3://{loc.bucket}/{loc.key(obj.name)}"
    head = _call(what, client.head_object, Bucket=loc.bucket, Key=loc.key(obj.name), ChecksumMode="ENABLED")
    if head["ContentLength"] != obj.size or head.get("ETag", "").strip('"') != obj.etag:
        raise ModelSourceError(f"{what} changed since it was listed; start again")
    info = object_info(head)
    if manifest_sha256:
        info = ObjectInfo(info.size, info.etag, info.version_id, info.md5, manifest_sha256)
    plan = _Plan(obj, what, version_pin(info), _split(obj.size, cfg.range_bytes), info)
    multipart = _MULTIPART_ETAG.match(obj.etag) if etag_is_md5(head) else None
    if multipart:
        # Not pinned (some S3 implementations compare If-Match with the part's ETag): the GETs are.
        part = _call(what, client.head_object, Bucket=loc.bucket, Key=loc.key(obj.name), PartNumber=1)["ContentLength"]
        if part > 0 and -(-obj.size // part) == int(multipart[2]):  # parts of one size (all but the last)
            plan.ranges, plan.parts_md5 = _split(obj.size, part), multipart[1]
    if not (info.sha256 or info.md5 or plan.parts_md5):
        log.warning(
            "%s: no checksum to verify it by (parts of unequal size, or an SSE-KMS ETag); only its size "
            "is checked: list it in a %s manifest",
            what,
            MANIFEST,
        )
    return plan


def _get_range(client, loc: S3Uri, plan: _Plan, fd: int, rng: tuple[int, int], chunk_bytes: int) -> bytes:
    """Write bytes [start, end) of the object at the same offsets of fd; their MD5."""
    start, end = rng
    body = _call(
        plan.what,
        client.get_object,
        Bucket=loc.bucket,
        Key=loc.key(plan.obj.name),
        Range=f"bytes={start}-{end - 1}",
        **plan.pin,
    )["Body"]
    digest, pos = hashlib.md5(usedforsecurity=False), start
    try:
        for chunk in _chunks(plan, body, chunk_bytes):
            if pos + len(chunk) > end:
                raise _refused(plan, f"bytes {start}-{end - 1} came back longer than asked")
            if os.pwrite(fd, chunk, pos) != len(chunk):
                raise OSError(f"short write to the cache at {plan.obj.name}")
            digest.update(chunk)
            pos += len(chunk)
    finally:
        body.close()
    if pos != end:
        raise _refused(plan, f"bytes {start}-{end - 1}: got {pos - start} of {end - start} (truncated)")
    return digest.digest()


def _verify(plan: _Plan, path: Path) -> None:
    if plan.parts_md5:
        got = hashlib.md5(b"".join(plan.part_digests), usedforsecurity=False).hexdigest()
        if got != plan.parts_md5:
            raise _refused(plan, f"multipart ETag mismatch (got {got}, expected {plan.parts_md5})")
    if len(plan.part_digests) == 1 and plan.info.md5 and not plan.info.sha256:  # one GET: its MD5 is the object's
        got = plan.part_digests[0].hex()
        if got != plan.info.md5:
            raise _refused(plan, f"MD5 mismatch (got {got}, expected the ETag {plan.info.md5})")
        return
    wanted = [(algo, hex_) for algo, hex_ in (("md5", plan.info.md5), ("sha256", plan.info.sha256)) if hex_]
    digests = [hashlib.new(algo, usedforsecurity=False) for algo, _ in wanted]
    with open(path, "rb") as f:  # ranges arrived out of order: one pass over the written file
        while digests and (block := f.read(16 << 20)):
            for d in digests:
                d.update(block)
    for (algo, want), d in zip(wanted, digests):
        if d.hexdigest() != want:
            raise _refused(plan, f"{algo.upper()} mismatch (got {d.hexdigest()}, expected {want})")


def _read_manifest(client, loc: S3Uri, manifest: _Object) -> dict[str, str]:
    """SHA256SUMS as {file name: sha256 hex}: lines ``<sha256>  <name>`` (``sha256sum *`` writes them)."""
    what = f"s3://{loc.bucket}/{loc.key(MANIFEST)}"
    if manifest.size > 1 << 20:
        raise ModelSourceError(f"{what} is {manifest.size} bytes; a checksum manifest is a few KB")
    resp = _call(what, client.get_object, Bucket=loc.bucket, Key=loc.key(MANIFEST), IfMatch=f'"{manifest.etag}"')
    sums = {}
    for i, line in enumerate(resp["Body"].read().decode("utf-8", "replace").splitlines(), 1):
        if line.strip():
            m = _MANIFEST_LINE.match(line.strip())
            if not m:
                raise ModelSourceError(f"{what} line {i} is not `<sha256>  <file name>`: {line[:80]!r}")
            sums[m[2]] = m[1].lower()
    return sums


def _chunks(plan: _Plan, body, chunk_bytes: int):
    """The body's chunks; a failure while reading it (not while writing them) as a ModelSourceError."""
    from botocore.exceptions import FlexibleChecksumError

    try:
        yield from body.iter_chunks(chunk_bytes)
    except FlexibleChecksumError as exc:  # boto3 checked a checksum header the response carried
        raise _refused(plan, str(exc)) from None
    except client_errors() as exc:
        raise ModelSourceError(str(fetch_error(exc, plan.what))) from None


def _call(what: str, op, **kwargs):
    try:
        return op(**kwargs)
    except client_errors() as exc:
        raise ModelSourceError(str(fetch_error(exc, what))) from None


def _refused(plan: _Plan, why: str) -> ModelSourceError:
    return ModelSourceError(f"{plan.what} failed verification: {why}; refused, nothing was cached")


def _split(size: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def _create(path: Path, size: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.ftruncate(fd, size)
    return fd


def _size_or_none(path: Path) -> int | None:
    try:
        return os.lstat(path).st_size if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None
