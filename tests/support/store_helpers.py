"""Helpers for the adapter-store tests: tiny PEFT adapters written straight to safetensors
(PEFT's own save is ~0.5 s per adapter: too slow for hundreds), S3 upload, comparison, and a
store config for a test S3 endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters_store.manifest import parse_manifest
from adapters_store.peft_weights import LoraWeights, ModelShape, parse_weights
from adapters_store.sources import LocalSource

WEIGHTS = "adapter_model.safetensors"

# The shape of tests.support.helpers.make_tiny_llama (hidden 64, 8 heads, 2 KV heads, MLP 160, 3 layers), written
# out so that store tests need no model (test_store_s3 checks it against the real config).
TINY_SHAPE = ModelShape(
    3,
    {
        "q_proj": (64, 64),
        "k_proj": (64, 16),
        "v_proj": (64, 16),
        "o_proj": (64, 64),
        "gate_proj": (64, 160),
        "up_proj": (64, 160),
        "down_proj": (160, 64),
    },
)


def write_adapter(
    out: Path, shape: ModelShape, rank: int = 2, targets=("q_proj", "v_proj"), seed: int = 0, alpha: float | None = None
) -> Path:
    """A PEFT LoRA directory with random A [r, in] and B [out, r] for every layer and target."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(shape.num_layers):
        for m in targets:
            d_in, d_out = shape.dims[m]
            group = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{m}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen)
            state[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha or 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def upload_client(endpoint: str, config=None):
    """A boto3 S3 client for the tests' own uploads to moto, sending no `Expect: 100-continue`:
    moto's server can answer that header twice, and botocore may then read the second answer
    as the response's status line, so a PUT fails with ConnectionClosedError now and then
    (seen once in CI; moto pull request 9975). The store under test only reads."""
    import boto3
    import botocore.handlers

    client = boto3.client("s3", endpoint_url=endpoint, config=config)
    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return client


def upload_dir(client, bucket: str, prefix: str, local: Path) -> str:
    """Upload a PEFT directory's files to s3://bucket/prefix/ and return that URI."""
    for f in sorted(local.iterdir()):
        if f.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    return f"s3://{bucket}/{prefix}/"


def load_local(name: str, adapter_dir: Path, max_rank: int, shape: ModelShape) -> LoraWeights:
    """The adapter read the plain way, as the tests' reference for the store's fast path: the
    product's local source (its checks and version), manifest and PEFT parser, no tiers."""
    source = LocalSource(adapter_dir)
    snap = source.snapshot()
    blob, _ = source.read_weights(snap)
    return parse_weights(name, parse_manifest(snap.config, max_rank), blob, shape, snap.version)


def assert_same_weights(got, want) -> None:
    assert got.manifest == want.manifest
    assert set(got.tensors) == set(want.tensors)
    for where, (a, b) in want.tensors.items():
        assert torch.equal(got.tensors[where][0], a) and torch.equal(got.tensors[where][1], b), where


def store_config(endpoint_url: str, root: Path, **overrides):
    """A store config for the S3 server at endpoint_url (usually the fault proxy), test-sized timeouts."""
    from adapters_store.disk_cache import DiskCacheConfig
    from adapters_store.s3_source import S3Config
    from adapters_store.store_config import StoreConfig

    s3_cfg = S3Config(endpoint_url=endpoint_url, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=2)
    return StoreConfig(**{"max_rank": 16, "disk": DiskCacheConfig(root / "cache"), "s3": s3_cfg, **overrides})


@pytest.fixture(autouse=True)
def one_torch_thread():
    """For the tiny model's engine tests (autouse where imported): a hidden size of 64 gains nothing
    from a second thread, and on a busy 2-core box two threads spin-waiting on each other make
    each step ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
