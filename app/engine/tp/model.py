"""A tensor-parallel model: N shard workers run the forward in lock-step over torch.distributed.

Rank 0 lives in the engine's process (a Serve replica's actor): the engine (scheduler,
batch building, sampling) runs there once and sees ``TensorParallelModel`` as its model.
Each forward first sends the step's inputs to ranks 1…N−1, then runs rank 0's shard; the
ranks meet in the all-reduces after o and down (app/engine/tp/sharding.py). Adapter
loads go the same way, in the same order, so every rank's slot holds its shard of the
same adapter before any step reads it. Workers are Ray actors in the replica's placement
group bundles 1…N−1 (under Serve) or spawned processes (elsewhere, e.g. tests).

Collectives: NCCL for the data on GPUs (NVLink multicast off: NCCL_NVLS_ENABLE=0), gloo
on CPUs; the control messages always go over gloo. A failed step leaves the ranks out of
step, so the model refuses every later step: the replica must be replaced.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from adapters_store.gpu_pool import LoraPool, PoolConfig
from app.engine.config import EngineConfig
from app.engine.tp.group import WorkerSpec, indexed, join, rendezvous, shard_model
from app.engine.tp.sharding import Shard, shard_adapter
from app.engine.tp.wire import Channel
from app.engine.tp.workers import LocalWorkers, RayWorkers, current_placement_group, node_ip
from app.model.llama import LlamaModel


class ShardedLoraPool(LoraPool):
    """Rank 0's adapter slots: every load shards the adapter (from the one host-cache copy)
    and sends ranks 1…N−1 their shards before filling rank 0's."""

    def __init__(self, shape, config: PoolConfig, world: int, on_load=lambda nbytes, seconds: None):
        super().__init__(shape, config, on_load)
        self.world = world
        self.channel: Channel | None = None  # set once the workers have joined

    def _load(self, slot: int, weights) -> None:
        shards = [shard_adapter(weights, Shard(r, self.world), self.config.dtype) for r in range(self.world)]
        m = weights.manifest
        self.channel.send_load(slot, m.rank, m.scale, [s.stacks for s in shards[1:]])
        super()._load(slot, shards[0])


class TensorParallelModel:
    """What the engine drives: rank 0's shard, which first tells the workers what to run."""

    def __init__(self, local: LlamaModel, channel: Channel, workers):
        self.local, self.channel, self.workers = local, channel, workers
        self.cfg, self.lora_pool, self.dtype = (
            local.cfg,
            local.lora_pool,
            local.dtype,
        )  # the shard's shape: KV is per shard
        self.broken: BaseException | None = None  # the failed step that left the ranks out of step

    def forward(self, inp, kv_caches) -> torch.Tensor:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel ranks are out of step since a failed step ({self.broken})")
        try:
            self.channel.send_step(inp)
            return self.local.forward(inp, kv_caches)
        except BaseException as exc:
            self.broken = exc
            raise

    def shutdown(self) -> None:
        """Stop the workers (the model is unusable afterwards)."""
        if self.broken is None:
            self.channel.send_stop()
        self.workers.join(timeout=30 if self.broken is None else 0)  # out of step: nothing to wait for
        dist.destroy_process_group()


def build_tp_model(path: Path, config: EngineConfig, pool_config: PoolConfig, on_load) -> TensorParallelModel:
    """Start ranks 1…N−1 (Ray actors inside a placement group, else local processes), then
    join them as rank 0 with this process's shard and a ShardedLoraPool."""
    pg = current_placement_group()
    host = node_ip() if pg is not None else "127.0.0.1"
    spec = WorkerSpec(str(path), rendezvous(host), config, pool_config)
    workers = RayWorkers(spec, pg) if pg is not None else LocalWorkers(spec)
    device = indexed(workers.device)
    control, data = join(0, spec, device)
    world = config.tensor_parallel_size
    local = shard_model(0, spec, device, data, lambda shape, pc: ShardedLoraPool(shape, pc, world, on_load))
    local.lora_pool.channel = Channel(world, device, control, data)
    return TensorParallelModel(local, local.lora_pool.channel, workers)
