"""`adapter_source` and `adapter_cache` in serve_config.yaml args → the AdapterStore's config.

Tiers below the GPU slots (`max_loras` / `lora_memory_gb`): host memory (parsed,
in the serving dtype), then verified local copies of S3 objects on disk. A budget
left out is sized from the machine that parses the config (`serve run`'s); one that
cannot fit there, or holds no adapter of `max_lora_rank`, is refused by name.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.disk_cache import DiskCacheConfig
from adapters_store.errors import AdapterUriError
from adapters_store.host_cache import HostCacheConfig
from adapters_store.paths import parse_uri
from adapters_store.store import StoreConfig

_GIB = 2**30
HOST_DEFAULT_MAX = 8 * _GIB  # at most an eighth of the machine's memory
DISK_DEFAULT_MAX = 64 * _GIB  # at most a quarter of the free disk


class AdapterCacheArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    host_gb: float | None = Field(None, gt=0)  # None: min(8 GiB, memory / 8)
    disk_gb: float | None = Field(None, gt=0)  # None: min(64 GiB, free disk at disk_dir / 4)
    disk_dir: str | None = Field(None, min_length=1)  # None: $LORAPLEX_ADAPTER_CACHE or ~/.cache/loraplex/adapters
    miss_ttl_s: float = Field(10.0, gt=0)  # a name found missing or invalid is answered 404/400 this long, no lookup
    workers: int = Field(4, ge=1)  # concurrent loads of distinct adapters per replica


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def source_uri(source: str | None) -> str | None:
    """The on-demand root, checked: ``s3://bucket/prefix/`` or an existing local directory (absolute)."""
    if source is None:
        return None
    try:
        where = parse_uri(source)
    except AdapterUriError as exc:
        raise ValueError(f"adapter_source: {exc}") from None
    if isinstance(where, Path):
        if not where.is_dir():
            raise ValueError(f"adapter_source: no directory {str(where)!r}")
        return str(where.resolve())
    return str(where).rstrip("/") + "/"


def store_config(cache: AdapterCacheArgs, source: str | None, max_rank: int) -> StoreConfig:
    """ValueError naming the field when a budget cannot fit on this machine."""
    memory = _memory_bytes()
    host = int(cache.host_gb * _GIB) if cache.host_gb else min(HOST_DEFAULT_MAX, memory // 8)
    if host > memory // 2:
        raise ValueError(
            f"adapter_cache.host_gb: {host / _GIB:.1f} GiB is more than half of this machine's "
            f"{memory / _GIB:.1f} GiB of memory"
        )
    disk_cfg = (
        DiskCacheConfig() if cache.disk_dir is None else DiskCacheConfig(Path(cache.disk_dir).expanduser().absolute())
    )
    usage = shutil.disk_usage(_existing(disk_cfg.root))
    disk = int(cache.disk_gb * _GIB) if cache.disk_gb else min(DISK_DEFAULT_MAX, usage.free // 4)
    if disk > usage.total:
        raise ValueError(
            f"adapter_cache.disk_gb: {disk / _GIB:.1f} GiB is more than the "
            f"{usage.total / _GIB:.1f} GiB disk holding {str(disk_cfg.root)!r}"
        )
    return StoreConfig(
        max_rank=max_rank,
        host=HostCacheConfig(budget_bytes=host),
        disk=replace(disk_cfg, budget_bytes=disk),
        miss_ttl_s=cache.miss_ttl_s,
        workers=cache.workers,
        default_root=source_uri(source),
    )
