"""The adapter store's configuration (its tiers' budgets, its S3 client, its on-demand source),
and the check that its budgets can hold one adapter of the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapters_store.disk_cache import DiskCacheConfig
from adapters_store.gpu_pool import adapter_bytes
from adapters_store.host_cache import HostCacheConfig
from adapters_store.peft_weights import ModelShape
from adapters_store.s3_source import S3Config


@dataclass(frozen=True)
class StoreConfig:
    """AdapterStore's configuration (app/serving/adapter_args.py builds it from serve_config.yaml)."""

    max_rank: int = 64
    host: HostCacheConfig = HostCacheConfig()
    disk: DiskCacheConfig = field(default_factory=DiskCacheConfig)
    s3: S3Config = S3Config()
    miss_ttl_s: float = 10.0
    workers: int = 4  # loader threads: concurrent downloads of distinct adapters
    default_root: str | None = None  # e.g. "s3://bucket/adapters/": unregistered names load from root/<name>/


def check_budgets(shape: ModelShape, config: StoreConfig) -> None:
    """Refuse, by name, a host or disk budget that cannot hold one adapter of the largest rank."""
    for what, budget, dtype in (
        ("adapter_cache.host_gb", config.host.budget_bytes, config.host.dtype),
        ("adapter_cache.disk_gb", config.disk.budget_bytes, torch.float32),  # files: fp32 at most
    ):
        largest = adapter_bytes(shape, config.max_rank, dtype)
        if budget < largest:
            raise ValueError(
                f"{what} ({budget} bytes) holds no adapter: one of rank {config.max_rank} on "
                f"every module takes {largest} bytes"
            )
