"""Ranks 1…N−1 of a tensor-parallel model: each builds its shard, then runs rank 0's messages
(app/engine/tp/wire.py) until told to stop. They run as Ray actors in the replica's placement group
bundles 1…N−1 (under Serve) or as spawned processes (elsewhere, e.g. tests)."""

from __future__ import annotations

import multiprocessing
import os

import torch
import torch.distributed as dist

from app.engine.kv_cache import allocate_kv
from app.engine.tp.group import WorkerSpec, indexed, join, shard_model
from app.engine.tp.wire import LOAD, STEP, Channel
from ops.lora import prepare as prepare_lora_kernels


def worker_main(rank: int, spec: WorkerSpec, device: str) -> None:
    """Rank ≥ 1: build the shard, then run rank 0's messages until it says stop."""
    device = indexed(device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.config.tensor_parallel_size))
    control, data = join(rank, spec, device)
    model = shard_model(rank, spec, device, data)
    c, e = model.cfg, spec.config
    kv = allocate_kv(c.num_layers, e.num_kv_blocks, e.block_size, c.num_kv_heads, c.head_dim, e.dtype, device)
    prepare_lora_kernels(e.dtype, spec.pool.max_rank, device)
    channel = Channel(e.tensor_parallel_size, device, control, data)
    while True:
        kind, message = channel.receive()
        if kind == STEP:
            model.forward(message, kv)
        elif kind == LOAD:
            _fill_slot(model.lora_pool, message)
        else:
            break
    dist.destroy_process_group()


def _fill_slot(pool, message: dict) -> None:
    """Write this rank's shard (received on this device) into the slot on the current stream:
    ordered before the next step."""
    from adapters_store.peft_weights import ModuleStack

    stacks = {m: ModuleStack(tuple(s["layers"]), s["A"], s["Bt"]) for m, s in message["stacks"].items()}
    pool.fill(message["slot"], stacks, message["rank"], message["scale"])


class LocalWorkers:
    """Ranks 1…N−1 as spawned processes of this machine (GPU r for rank r)."""

    def __init__(self, spec: WorkerSpec):
        ctx = multiprocessing.get_context("spawn")
        base = torch.device(spec.config.device)
        devices = [
            f"cuda:{(base.index or 0) + r}" if base.type == "cuda" else "cpu"
            for r in range(spec.config.tensor_parallel_size)
        ]
        self.device = devices[0]
        self.procs = [
            ctx.Process(target=worker_main, args=(r, spec, devices[r]), daemon=True, name=f"tp-rank{r}")
            for r in range(1, spec.config.tensor_parallel_size)
        ]
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
        self.actors = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if cuda else 0,
                name=f"tp-worker-{os.getpid()}-rank{r}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=r),
                runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}},
            ).remote()
            for r in range(1, spec.config.tensor_parallel_size)
        ]
        self.runs = [a.run.remote(r, spec, self.device) for r, a in enumerate(self.actors, start=1)]

    def join(self, timeout: float = 30) -> None:
        import ray

        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for a in self.actors:
            ray.kill(a)


class _RayWorker:
    def run(self, rank: int, spec: WorkerSpec, device: str) -> None:
        worker_main(rank, spec, device)


def current_placement_group():
    try:
        import ray
    except ImportError:
        return None
    return ray.util.get_current_placement_group() if ray.is_initialized() else None


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
