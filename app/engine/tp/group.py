"""What every tensor-parallel rank shares: the spec it is started with, joining the process
group, and building its shard of the model (app/engine/tp/sharding.py) with its adapter slots."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from adapters_store.gpu_pool import LoraPool, PoolConfig
from app.engine.config import EngineConfig
from app.engine.tp.sharding import Shard, load_shard_weights, shard_config
from app.model.config import ModelConfig
from app.model.llama import LlamaModel

# Workers wait for the next step as long as the replica lives: an idle replica is not an error.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard (identical on all ranks)."""

    model_path: str
    init_method: str  # tcp://host:port of rank 0's rendezvous
    config: EngineConfig
    pool: PoolConfig  # its device is rank 0's; each rank uses its own


def join(rank: int, spec: WorkerSpec, device: torch.device):
    """Join the group; (control group, data group), None meaning the default group."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device docs)
    world, timeout = spec.config.tensor_parallel_size, IDLE_TIMEOUT
    if device.type != "cuda":
        dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=world, timeout=timeout)
        return None, None
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=spec.init_method, rank=rank, world_size=world, device_id=device)
    return dist.new_group(backend="gloo", timeout=timeout), None


def all_reduce(group):
    def reduce(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=group)
        return y

    return reduce


def shard_model(rank: int, spec: WorkerSpec, device: torch.device, data, make_pool=LoraPool) -> LlamaModel:
    """This rank's shard; make_pool(shape, PoolConfig) builds its adapter slots."""
    from transformers import AutoConfig

    full = ModelConfig.from_hf(AutoConfig.from_pretrained(spec.model_path), spec.config.quantization)
    cfg = shard_config(full, spec.config.tensor_parallel_size)
    weights = load_shard_weights(
        Path(spec.model_path), full, Shard(rank, spec.config.tensor_parallel_size), spec.config.dtype, device
    )
    p = spec.pool
    pool = make_pool(cfg.shape, PoolConfig(p.num_slots, p.max_rank, p.dtype, str(device)))
    return LlamaModel(cfg, weights, pool, reduce=all_reduce(data))


def indexed(name: str) -> torch.device:
    """The device with an index (bare "cuda" → the current one): NCCL and set_device want it."""
    device = torch.device(name)
    return (
        torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
    )


def rendezvous(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"
