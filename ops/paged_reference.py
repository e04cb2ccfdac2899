"""fp32 torch reference of attention over the paged KV cache, as ops/reference.py is for SGMV:
the semantics the CUDA path (ops/paged_attention.py) is held to, and the attention of every step
the CUDA kernels do not serve (the CPU; on CUDA, head layouts and page sizes they lack).

It reads the one step format, `PagedBatch`: prefill rows (each request's new tokens, causal over
its whole context, the context's last tokens being the request's rows: cu_q / cu_k offsets,
kv_index the flat cache slot of each context token) and decode rows (one query each over the
first context_lens[s] tokens of block table s; a row of length 0, a CUDA graph's padding, gets
zeros). Grouped-query attention: query head h reads KV head h // (heads / kv_heads). window: a
query at position p sees keys p - window < k <= p only (HF's sliding window); softcap: scores
softcap * tanh(scores / softcap) before the mask (HF's eager Gemma 2).

Readable, and still the CPU's fast path: each part gathers its context once per layer into
contiguous K/V (index_select) and makes one torch SDPA call (per prefill request; one for all
decode rows), so no padded copy of the prompt is built. Everything runs in fp32 (a no-op for an
fp32 model), or in float64 for a float64 one, and is rounded to out's dtype once. A float64 engine
(CPU only) exists so that a request resumed elsewhere, its context recomputed by a prefill instead
of decode steps, samples the tokens of the uninterrupted run: fp32 attention there moved a sampled
draw of the tiny test model's near-uniform distribution across a token boundary (the scale-down
test's flake, tests/unit/test_migration_precision.py), so it is never narrowed to fp32.
"""

import torch
import torch.nn.functional as F

from .paged_attention import DecodeRows, PagedBatch, PrefillRows


def forward(
    out, q, k_cache, v_cache, batch: PagedBatch, scale: float, window: int | None = None, softcap: float | None = None
):
    """Both parts of a step (prefill rows first, then decode rows) into out.

    out, q: [tokens, heads, D]; caches: [blocks, block_size, kv_heads, D], already holding this
    step's KV."""
    if batch.prefill is not None:
        prefill(out, q, k_cache, v_cache, batch.prefill, scale, window, softcap)
    if batch.decode is not None:
        decode(out, q, k_cache, v_cache, batch.decode, scale, window, softcap)
    return out


def prefill(out, q, k_cache, v_cache, rows: PrefillRows, scale: float, window=None, softcap=None):
    """out[t] for t < rows.tokens: each request's rows over its own context (bottom-right causal)."""
    k = _flat(k_cache).index_select(0, rows.kv_index)  # [sum of contexts, kv_heads, D]
    v = _flat(v_cache).index_select(0, rows.kv_index)
    group = q.shape[1] // k.shape[1]
    cu_q, cu_k = rows.cu_q.tolist(), rows.cu_k.tolist()  # a host sync on CUDA: fine for a reference
    for r in range(len(cu_q) - 1):
        n, ctx = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        # query rows are folded (head in group, query): see _attend
        q_pos = torch.arange(ctx - n, ctx, device=q.device).repeat(group)[:, None]
        visible = _visible(q_pos, torch.arange(ctx, device=q.device), window)
        keys = slice(cu_k[r], cu_k[r + 1])
        o = _attend(q[None, cu_q[r] : cu_q[r + 1]], k[None, keys], v[None, keys], visible, scale, softcap)
        out[cu_q[r] : cu_q[r + 1]] = o[0].to(out.dtype)
    return out


def decode(out, q, k_cache, v_cache, rows: DecodeRows, scale: float, window=None, softcap=None):
    """out[first + s] for each decode row s: its one query over its block table's first
    context_lens[s] tokens (padded to the table's width, the padding masked)."""
    n, block_size = rows.context_lens.shape[0], k_cache.shape[1]
    if n == 0:
        return out
    offsets = torch.arange(block_size, device=q.device)
    slots = (rows.block_tables.long()[:, :, None] * block_size + offsets).flatten()  # [n * keys]
    kv_shape = (n, -1, *k_cache.shape[2:])
    k = _flat(k_cache).index_select(0, slots).view(kv_shape)  # [n, keys, kv_heads, D]
    v = _flat(v_cache).index_select(0, slots).view(kv_shape)
    lens = rows.context_lens.long().view(n, 1, 1, 1)
    visible = _visible(lens - 1, torch.arange(k.shape[1], device=q.device), window)  # [n, 1, 1, keys]
    o = _attend(q[rows.first : rows.first + n, None], k, v, visible, scale, softcap)[:, 0]
    out[rows.first : rows.first + n] = torch.where(lens[:, :, 0] > 0, o, 0).to(out.dtype)
    return out


def _flat(cache):
    return cache.view(-1, *cache.shape[2:])  # [slots, kv_heads, D]


def _visible(q_pos, k_pos, window: int | None):
    """Keys k_pos <= q_pos (within the window), broadcast over both."""
    visible = k_pos <= q_pos
    return visible if window is None else visible & (k_pos > q_pos - window)


def _attend(q, k, v, visible, scale: float, softcap: float | None):
    """fp32 (float64 for float64 q) softmax attention of q [B, Lq, heads, D] over k, v [B, Lk,
    kv_heads, D]; visible: bool, broadcastable to [B, kv_heads, group * Lq, Lk]. The heads sharing a KV head become extra query
    rows of it (rows ordered (head in group, query)), so K/V are not repeated. -> [B, Lq, heads, D]."""
    b, lq, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)  # half types widen to fp32, float64 stays
    qf = q.to(dtype).view(b, lq, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * lq, d)
    kf, vf = k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)  # [B, kv_heads, Lk, D]
    # an additive mask keeps SDPA on its fast CPU path (a bool mask with these shapes is far slower)
    mask = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    if softcap is None:
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    else:  # SDPA has no soft-capping
        s = torch.tanh((qf @ kf.transpose(-1, -2)) * scale / softcap) * softcap + mask
        o = torch.softmax(s, dim=-1) @ vf
    return o.view(b, kv_heads, group, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, heads, d)
