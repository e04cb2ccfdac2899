"""Serve options that give one LoraReplica the N GPUs of a tensor-parallel model.

As Ray Serve LLM does for vLLM: one placement-group bundle per GPU, STRICT_PACK (one
node: the shards all-reduce twice per layer, so they need NVLink, not the network).
Serve pins the replica actor — rank 0, which also runs the engine — to bundle 0 and
creates the group with the replica, so the router and the autoscaler see one replica
with one engine; the shard workers (app/engine/tp/workers.py) are its child actors in
bundles 1…N−1 and die with it.
"""

from __future__ import annotations


def tensor_parallel_options(options: dict, tensor_parallel_size: int, device: str) -> dict:
    """LoraReplica's Serve options (what ``.options()`` takes) for a replica spanning
    ``tensor_parallel_size`` devices; unchanged for 1."""
    if tensor_parallel_size == 1:
        return options
    actor = dict(options.get("ray_actor_options") or {})
    gpu = {"GPU": 1} if device.startswith("cuda") else {}
    actor.update(num_cpus=actor.get("num_cpus", 1), num_gpus=gpu.get("GPU", 0))
    worker = {"CPU": 1, **gpu}  # what app/engine/tp/workers.RayWorkers asks for each worker
    return {
        **options,
        "ray_actor_options": actor,
        "placement_group_bundles": [{"CPU": actor["num_cpus"], **gpu}] + [worker] * (tensor_parallel_size - 1),
        "placement_group_strategy": "STRICT_PACK",
    }
