"""Rotary position embedding (neox/HF half-rotation layout)."""

import torch

from . import small_ops
from .attention import write_kv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype):
    """cos, sin: [tokens, head_dim] for positions: [tokens] int, inv_freq: [head_dim/2]."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x: [tokens, heads, head_dim], cos/sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads: int, kv_heads: int, head_dim: int):
    """RoPE on q and k of qkv, this step's k and v into the cache; returns q [tokens, heads, head_dim].

    qkv: [tokens, (heads + 2 * kv_heads) * head_dim]; caches: [blocks, block_size, kv_heads,
    head_dim]; slot_mapping: [tokens] flat slot. With int32 slots (the paged step builder's) on
    CUDA fp16/bf16, one kernel in place on qkv; otherwise the torch ops.
    """
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    if small_ops.usable(qkv) and head_dim in small_ops.HEAD_DIMS and slot_mapping.dtype == torch.int32:
        small_ops.rope_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim)
        return qkv[:, :q_dim].view(-1, heads, head_dim)
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q = apply_rope(q.view(-1, heads, head_dim), cos, sin)
    k = apply_rope(k.view(-1, kv_heads, head_dim), cos, sin)
    write_kv(k_cache, v_cache, k, v.view(-1, kv_heads, head_dim), slot_mapping)
    return q
