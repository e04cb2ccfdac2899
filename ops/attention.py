"""Attention over a paged KV cache.

The engine builds one ``AttentionGroup`` per kind of sequence (prefill, decode)
once per step (on CUDA a `PagedBatch` instead: ops/paged_attention.py); every layer reuses it. A group pads its sequences to a common
query / context length, gathers their KV blocks through the block tables and
runs one masked SDPA call — prefill and decode are kept apart so a long prompt
does not pad every decode row.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import paged_attention as paged

# On CUDA, SDPA would pick cuDNN for a float mask, and cuDNN builds a new graph for
# every new context length (measured on the H200: 1.3 ms of host time per decode call,
# 11 ms per prefill call); the memory-efficient kernel takes any additive mask as is.
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class AttentionGroup:
    q_index: torch.Tensor  # [seqs, max_q] token row per query slot; padding → tokens (a zero row)
    kv_index: torch.Tensor  # [seqs, max_ctx] flat KV cache slot per key; padding → 0
    mask: torch.Tensor  # [seqs, 1, max_q, max_ctx] additive: 0 = attend, -inf = masked
    out_rows: torch.Tensor  # [n] token rows this group produces
    out_index: torch.Tensor  # [n] flat index into [seqs * max_q] for those rows

    def to(self, device) -> "AttentionGroup":
        return AttentionGroup(
            *(
                t.to(device, non_blocking=True)
                for t in (self.q_index, self.kv_index, self.mask, self.out_rows, self.out_index)
            )
        )


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k_cache/v_cache[slot_mapping[t]] = k/v[t], in place.

    caches: [blocks, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    slot_mapping: [tokens] int64 flat slot (block * block_size + offset).
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal additive mask [..., max_q, max_ctx] narrowed to a sliding window: query at
    position p sees keys p - window < k <= p (HF's sliding_window_overlay). A causal row's
    visible keys are the prefix 0..p, so p is read off the mask itself."""
    q_pos = (mask == 0).sum(-1, keepdim=True) - 1
    outside = torch.arange(mask.shape[-1], device=mask.device) <= q_pos - window
    return mask.masked_fill(outside, float("-inf"))


def _softcapped(q, k, v, mask, scale: float, softcap: float):
    """Eager attention with tanh soft-capping of the scores, rounded as HF's eager Gemma 2:
    scores in q's dtype, cap * tanh(scores / cap), + mask, softmax in fp32, back to q's dtype."""
    s = (q @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap + mask
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def paged_attention(out, q, k_cache, v_cache, groups, scale, window: int | None = None, softcap: float | None = None):
    """out[t] = softmax(q[t] K^T * scale + mask) V over each token's own sequence.

    out: [tokens, heads, head_dim] written in place; q: [tokens, heads, head_dim];
    caches: [blocks, block_size, kv_heads, head_dim] (already holding this step's KV).
    Grouped-query attention: heads is a multiple of kv_heads. ``groups``: AttentionGroups (the
    gather + SDPA path: CPU, and CUDA shapes the paged kernels lack), or a `PagedBatch`
    (CUDA: `ops.paged_attention`). window: keys p - window < k <= p only (None: all k <= p);
    softcap: scores = softcap * tanh(scores / softcap) before the mask (None: none).
    """
    if isinstance(groups, paged.PagedBatch):
        return paged.forward(out, q, k_cache, v_cache, groups, scale, window, softcap)
    q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # row `tokens` = padding
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], q.shape[2]
    group = heads // kv_heads
    for g in groups:
        seqs, max_q = g.q_index.shape
        # Heads sharing a KV head become extra query rows of that KV head (no K/V repeat);
        # an additive mask keeps SDPA on its fast CPU path (a bool mask with GQA is far slower).
        qg = q_pad[g.q_index].permute(0, 2, 1, 3).reshape(seqs, kv_heads, group * max_q, d)
        kg = k_flat[g.kv_index].transpose(1, 2)  # [seqs, kv_heads, max_ctx, d]
        vg = v_flat[g.kv_index].transpose(1, 2)
        mask = g.mask if window is None else window_mask(g.mask, window)
        mask = mask.to(q.dtype).repeat(1, 1, group, 1)  # rows ordered (head in group, query)
        if softcap is not None:
            o = _softcapped(qg, kg, vg, mask, scale, softcap)
        else:
            with sdpa_kernel(_CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        o = o.reshape(seqs, heads, max_q, d).transpose(1, 2).reshape(-1, heads, d)  # [seqs * max_q, heads, d]
        out[g.out_rows] = o[g.out_index]
    return out
