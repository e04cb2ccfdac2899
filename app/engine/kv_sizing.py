"""How many KV blocks a GPU holds: the sizing rule, as pure functions of the device's figures.

The engine keeps, per layer, a K and a V tensor of [blocks, block_size, kv_heads, head_dim]
(app/engine/kv_cache.py). One block table serves every layer, so a sliding-window layer keeps a
sequence's whole KV like a full-attention one: Mistral's or Gemma's window does not shrink a
block. Under tensor parallelism each GPU holds kv_heads / tp of the heads.

`num_kv_blocks: auto` (the default on CUDA) gives the KV cache

    budget = gpu_memory_utilization × device total − used − workspace

where ``used`` is what the device holds once the weights, the adapter slots and the kernels are
loaded (this process's and any other's), and ``workspace`` is the peak the engine needs beyond
its KV while it runs: activations of a step of max_tokens_per_step tokens, the sampler's
buffers for max_batch_size rows and the decode CUDA graphs, measured at start-up by a probe
engine (app/engine/kv_probe.py). An explicit number is taken as it is, but refused when it
exceeds ``total − used − workspace`` (all the device's memory), naming the largest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.startup import StartupError

GB = 2**30


class KvCacheError(StartupError):
    """The KV cache asked for (or the one auto can give) does not fit the device."""


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1
) -> int:
    """Bytes of one KV block on one GPU: K and V of every layer, this GPU's share of the KV heads.
    MHA (kv_heads = heads), GQA (fewer) and sliding-window families alike (see above)."""
    if num_kv_heads % tp:
        raise KvCacheError(f"tensor_parallel_size {tp} does not divide the {num_kv_heads} KV heads")
    return 2 * num_layers * block_size * (num_kv_heads // tp) * head_dim * dtype_bytes


@dataclass(frozen=True)
class KvPlan:
    """What the KV cache of one GPU is, and the figures that decided it (logged, reported)."""

    blocks: int
    block_size: int
    block_bytes: int
    mode: str  # "auto" or "explicit"
    device_total: int = 0  # bytes; 0 on the CPU (nothing measured)
    used: int = 0  # before the KV: weights, adapter slots, kernels, other processes
    workspace: int = 0  # the engine's peak beyond its KV (activations, sampler, graphs)
    utilization: float = 1.0

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def largest(self) -> int:
        """The most blocks the device could hold (all its memory, not just the utilization's share)."""
        return fitting_blocks(self.device_total, self.used, self.workspace, 1.0, self.block_bytes)

    def describe(self) -> str:
        head = f"KV cache ({self.mode}): {self.blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
        head += f"{self.bytes / GB:.2f} GB"
        if not self.device_total:
            return head
        return head + (
            f" (device {self.device_total / GB:.1f} GB x utilization {self.utilization:g}, "
            f"{self.used / GB:.2f} GB used before the KV, {self.workspace / GB:.2f} GB workspace; "
            f"at most {self.largest} blocks would fit)"
        )

    def as_dict(self) -> dict:
        return {
            "blocks": self.blocks,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "gb": round(self.bytes / GB, 3),
            "mode": self.mode,
            "device_total_gb": round(self.device_total / GB, 3),
            "used_gb": round(self.used / GB, 3),
            "workspace_gb": round(self.workspace / GB, 3),
            "utilization": self.utilization,
            "largest_blocks": self.largest if self.device_total else None,
        }


def fitting_blocks(total: int, used: int, workspace: int, utilization: float, block_bytes: int) -> int:
    """Blocks within ``utilization`` of ``total`` once ``used`` and ``workspace`` are set aside (≥ 0)."""
    if not 0 < utilization <= 1:
        raise KvCacheError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * total) - used - workspace
    return max(budget, 0) // block_bytes


def plan_kv(
    requested: int | None,
    *,
    total: int,
    used: int,
    workspace: int,
    utilization: float,
    block_bytes: int,
    block_size: int,
    min_blocks: int = 1,
) -> KvPlan:
    """The KV plan of one GPU. ``requested``: an explicit block count, or None (auto). ``min_blocks``:
    the fewest that serve one request of the longest allowed length (auto below it is refused)."""
    if requested is None:
        blocks = fitting_blocks(total, used, workspace, utilization, block_bytes)
        plan = KvPlan(blocks, block_size, block_bytes, "auto", total, used, workspace, utilization)
        if blocks < min_blocks:
            raise KvCacheError(
                f"num_kv_blocks auto: only {blocks} blocks ({blocks * block_size} tokens) fit beside the weights "
                f"({used / GB:.1f} GB used, {workspace / GB:.1f} GB workspace, {total / GB:.1f} GB x "
                f"{utilization:g}); one request of max_model_len needs {min_blocks}: lower max_model_len, "
                "max_batch_size or max_loras, raise gpu_memory_utilization, or use a larger GPU / tensor_parallel_size"
            )
        return plan
    plan = KvPlan(requested, block_size, block_bytes, "explicit", total, used, workspace, utilization)
    if total and requested > plan.largest:
        raise KvCacheError(
            f"num_kv_blocks {requested} ({requested * block_bytes / GB:.1f} GB) does not fit: "
            f"{(total - used - workspace) / GB:.1f} GB of the device's {total / GB:.1f} GB is left after the "
            f"weights, adapter slots and workspace; the largest that fits is {plan.largest} "
            "(or set num_kv_blocks: auto)"
        )
    return plan
