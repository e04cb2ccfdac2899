"""A tensor-parallel model: N shard workers run the forward in lock-step over torch.distributed.

Rank 0 lives in the engine's process (a Serve replica's actor): the engine (scheduler,
batch building, sampling) runs there once and sees ``TensorParallelModel`` as its model.
Each forward first sends the step's inputs to ranks 1…N−1, then runs rank 0's shard; the
ranks meet in the all-reduces after o and down (app/model/tensor_parallel.py). Adapter
loads go the same way, in the same order, so every rank's slot holds its shard of the
same adapter before any step reads it. Workers are Ray actors in the replica's placement
group bundles 1…N−1 (under Serve) or spawned processes (elsewhere, e.g. tests).

Collectives: NCCL for the data on GPUs (NVLink multicast off: NCCL_NVLS_ENABLE=0), gloo
on CPUs; the control messages always go over gloo. A failed step leaves the ranks out of
step, so the model refuses every later step: the replica must be replaced.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from adapters_store.gpu_pool import LoraPool, PoolConfig
from app.engine.config import EngineConfig
from app.engine.kv_cache import allocate_kv
from app.engine.tp_messages import LOAD, STEP, Channel
from app.model.config import ModelConfig
from app.model.llama import LlamaModel
from app.model.tensor_parallel import Shard, load_shard_weights, shard_adapter, shard_config
from ops.lora import prepare as prepare_lora_kernels

# Workers wait for the next step as long as the replica lives: an idle replica is not an error.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard (identical on all ranks)."""

    model_path: str
    init_method: str  # tcp://host:port of rank 0's rendezvous
    config: EngineConfig
    pool: PoolConfig  # its device is rank 0's; each rank uses its own


def _join(rank: int, spec: WorkerSpec, device: torch.device):
    """Join the group; (control group, data group), None meaning the default group."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device docs)
    world, timeout = spec.config.tensor_parallel_size, IDLE_TIMEOUT
    if device.type != "cuda":
        dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=world, timeout=timeout)
        return None, None
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=spec.init_method, rank=rank, world_size=world, device_id=device)
    return dist.new_group(backend="gloo", timeout=timeout), None


def _all_reduce(group):
    def reduce(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=group)
        return y
    return reduce


def _shard_model(rank: int, spec: WorkerSpec, device: torch.device, data, make_pool=LoraPool) -> LlamaModel:
    """This rank's shard; make_pool(shape, PoolConfig) builds its adapter slots."""
    from transformers import AutoConfig

    full = ModelConfig.from_hf(AutoConfig.from_pretrained(spec.model_path))
    cfg = shard_config(full, spec.config.tensor_parallel_size)
    weights = load_shard_weights(Path(spec.model_path), full, Shard(rank, spec.config.tensor_parallel_size),
                                 spec.config.dtype, device)
    p = spec.pool
    pool = make_pool(cfg.shape, PoolConfig(p.num_slots, p.max_rank, p.dtype, str(device)))
    return LlamaModel(cfg, weights, pool, reduce=_all_reduce(data))


def worker_main(rank: int, spec: WorkerSpec, device: str) -> None:
    """Rank ≥ 1: build the shard, then run rank 0's messages until it says stop."""
    device = _indexed(device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.config.tensor_parallel_size))
    control, data = _join(rank, spec, device)
    model = _shard_model(rank, spec, device, data)
    c, e = model.cfg, spec.config
    kv = allocate_kv(c.num_layers, e.num_kv_blocks, e.block_size, c.num_kv_heads, c.head_dim, e.dtype, device)
    prepare_lora_kernels(e.dtype, spec.pool.max_rank, device)
    channel = Channel(e.tensor_parallel_size, device, control, data)
    while True:
        kind, message = channel.receive()
        if kind == STEP:
            model.forward(message, kv)
        elif kind == LOAD:
            _fill(model.lora_pool, message)
        else:
            break
    dist.destroy_process_group()


def _fill(pool: LoraPool, message: dict) -> None:
    """Write this rank's shard (received on this device) into the slot on the current stream:
    ordered before the next step."""
    from adapters_store.peft_weights import ModuleStack

    stacks = {m: ModuleStack(tuple(s["layers"]), s["A"], s["Bt"]) for m, s in message["stacks"].items()}
    pool._fill(message["slot"], stacks, message["rank"], message["scale"])


class ShardedLoraPool(LoraPool):
    """Rank 0's adapter slots: every load shards the adapter (from the one host-cache copy)
    and sends ranks 1…N−1 their shards before filling rank 0's."""

    def __init__(self, shape, config: PoolConfig, world: int, on_load=lambda nbytes, seconds: None):
        super().__init__(shape, config, on_load)
        self.world = world
        self.channel: Channel | None = None  # set once the workers have joined

    def _load(self, slot: int, weights) -> None:
        pin = torch.device(self.config.device).type == "cuda"
        shards = [shard_adapter(weights, Shard(r, self.world), self.config.dtype, pin) for r in range(self.world)]
        m = weights.manifest
        self.channel.send_load(slot, m.rank, m.scale, [s.stacks for s in shards[1:]])
        super()._load(slot, shards[0])


class TensorParallelModel:
    """What the engine drives: rank 0's shard, which first tells the workers what to run."""

    def __init__(self, local: LlamaModel, channel: Channel, workers):
        self.local, self.channel, self.workers = local, channel, workers
        self.cfg, self.lora_pool, self.dtype = local.cfg, local.lora_pool, local.dtype  # the shard's shape: KV is per shard
        self.broken: BaseException | None = None

    def forward(self, inputs, kv_caches) -> torch.Tensor:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel ranks are out of step since a failed step ({self.broken})")
        try:
            self.channel.send_step(inputs)
            return self.local.forward(inputs, kv_caches)
        except BaseException as exc:
            self.broken = exc
            raise

    def shutdown(self) -> None:
        """Stop the workers (the model is unusable afterwards)."""
        if self.broken is None:
            self.channel.send_stop()
        self.workers.join(timeout=30 if self.broken is None else 0)  # out of step: nothing to wait for
        dist.destroy_process_group()


# -- where the workers run ---------------------------------------------------------------
class LocalWorkers:
    """Ranks 1…N−1 as spawned processes of this machine (GPU r for rank r)."""

    def __init__(self, spec: WorkerSpec):
        ctx = multiprocessing.get_context("spawn")
        base = torch.device(spec.config.device)
        devices = [f"cuda:{(base.index or 0) + r}" if base.type == "cuda" else "cpu"
                   for r in range(spec.config.tensor_parallel_size)]
        self.device = devices[0]
        self.procs = [ctx.Process(target=worker_main, args=(r, spec, devices[r]), daemon=True, name=f"tp-rank{r}")
                      for r in range(1, spec.config.tensor_parallel_size)]
        for p in self.procs:
            p.start()

    def join(self, timeout: float = 30) -> None:
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()


class RayWorkers:
    """Ranks 1…N−1 as Ray actors in bundles 1…N−1 of this replica's placement group (one GPU
    each, STRICT_PACK: one node); they die with the replica actor that owns them."""

    def __init__(self, spec: WorkerSpec, placement_group):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = torch.device(spec.config.device).type == "cuda"
        self.device = "cuda" if cuda else "cpu"  # Ray shows each actor only its own GPU
        actor = ray.remote(_RayWorker)
        self.actors = [actor.options(
            num_cpus=1, num_gpus=1 if cuda else 0, name=f"tp-worker-{os.getpid()}-rank{r}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=r),
            runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}},
        ).remote() for r in range(1, spec.config.tensor_parallel_size)]
        self.runs = [a.run.remote(r, spec, self.device) for r, a in enumerate(self.actors, start=1)]

    def join(self, timeout: float = 30) -> None:
        import ray

        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for a in self.actors:
            ray.kill(a)


class _RayWorker:
    def run(self, rank: int, spec: WorkerSpec, device: str) -> None:
        worker_main(rank, spec, device)


def _indexed(name: str) -> torch.device:
    """The device with an index (bare "cuda" → the current one): NCCL and set_device want it."""
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def _rendezvous(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def build_tp_model(path: Path, config: EngineConfig, pool_config: PoolConfig, on_load) -> TensorParallelModel:
    """Start ranks 1…N−1 (Ray actors inside a placement group, else local processes), then
    join them as rank 0 with this process's shard and a ShardedLoraPool."""
    pg = _current_placement_group()
    host = _node_ip() if pg is not None else "127.0.0.1"
    spec = WorkerSpec(str(path), _rendezvous(host), config, pool_config)
    workers = RayWorkers(spec, pg) if pg is not None else LocalWorkers(spec)
    device = _indexed(workers.device)
    control, data = _join(0, spec, device)
    world = config.tensor_parallel_size
    local = _shard_model(0, spec, device, data, lambda shape, pc: ShardedLoraPool(shape, pc, world, on_load))
    local.lora_pool.channel = Channel(world, device, control, data)
    return TensorParallelModel(local, local.lora_pool.channel, workers)


def _current_placement_group():
    try:
        import ray
    except ImportError:
        return None
    return ray.util.get_current_placement_group() if ray.is_initialized() else None


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
