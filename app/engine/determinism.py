"""`EngineConfig.deterministic`: which reduction order each op of the forward takes (ops/fixed_order.py),
a pure function of the config, and what the switch refuses.

On, every op on the prefill and decode path reduces in an order that does not depend on the batch:
base projections and LM head in fixed row tiles, attention per row with one split, SGMV with one
cluster width, the sampler per row (as always). A request's logits are then the same bits alone,
in any batch, after preemption, after a prefix-cache hit and after migration to another replica
with the same config and GPU. Off (the default): the libraries' per-shape choices, faster.
"""

from __future__ import annotations

import torch

from app.engine.config import EngineConfig
from ops import fixed_order, paged_decode
from ops.fixed_order import Paths
from ops.lora import prepare_fixed


def paths_for(config: EngineConfig) -> Paths:
    """The paths an engine of this config runs: fixed orders when deterministic, else the libraries'."""
    return fixed_order.fixed(config.device) if config.deterministic else fixed_order.LIBRARY


def model_refusal(config: EngineConfig, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> str | None:
    """Why this model cannot run the fixed paths on this config's device (None: it can): on CUDA
    fixed-order attention is the decode kernel's, which serves only some head layouts."""
    if not config.deterministic or torch.device(config.device).type != "cuda":
        return None
    if not paged_decode.supported(dtype, head_dim, heads, kv_heads, config.block_size):
        return (
            f"deterministic: no fixed-order attention on CUDA for head_dim {head_dim}, {heads}/{kv_heads} heads, "
            f"block_size {config.block_size} (the decode kernel's shapes: ops/paged_decode.py)"
        )
    return None


def apply(model, config: EngineConfig) -> Paths:
    """Give the model its config's paths (a LlamaModel reads them in forward); refuse a model they
    cannot serve. On CUDA, a fixed cuBLAS workspace where none is set yet."""
    paths = paths_for(config)
    if not config.deterministic:  # a model's own default: the libraries' paths
        return paths
    c = model.cfg
    why = model_refusal(config, model.dtype, c.head_dim, c.num_heads, c.num_kv_heads)
    if why is not None:
        raise ValueError(why)
    if torch.device(config.device).type == "cuda":
        index = torch.device(config.device).index
        major, _ = torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)
        if major < 9:  # ops/lora.py FIXED_SGMV: before sm_90 the SGMV's k order follows the item's rows
            raise ValueError("deterministic: needs an sm_90 GPU or newer (SGMV has no fixed-order path before it)")
        fixed_order.pin_cuda_workspace()
        if model.lora_pool is not None:
            pool = model.lora_pool.config
            prepare_fixed(pool.dtype, pool.max_rank, pool.device)
    model.paths = paths
    return paths


def stats(config: EngineConfig) -> dict:
    """What the replica reports: the switch and the paths it selected."""
    return {"deterministic": config.deterministic, "paths": paths_for(config).as_dict()}
