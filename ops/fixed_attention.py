"""Attention in a fixed order per query row (`ops.fixed_order`'s `per_row`): every row of a step,
prefill or decode, is one query over the first L keys of its own context (L: its position + 1),
reduced in an order that depends on L alone. So a token's attention output is the same computed
in a prefill (a first prompt, a prefix-cache hit's tail, a migrated request's recompute) or in a
decode step, alone or in any batch.

CUDA (the shapes ops/paged_decode.py serves): the decode kernel with one split for all rows, the
prefill rows turned into decode rows (`as_decode_rows`). A block per (row, KV head) walks the
context in the same tiles whatever the grid; the library path instead picks split counts from the
batch (decode) and runs FlashAttention's query tiles (prefill).

Elsewhere (the CPU): torch, `rows_forward`: scores as elementwise products summed over the head
dim, softmax sums and the weighted V sums over chunks of KEY_CHUNK keys, each chunk reduced alone
and the chunks added left to right. Padding (a shorter row in a tile of longer ones) adds exact
zeros after the row's own chunks, which changes no bit.
"""

from __future__ import annotations

import torch

from .paged_attention import DecodeRows, PagedBatch, PrefillRows

KEY_CHUNK = 64  # keys per chunk of the torch path's sums
ROW_TILE = 16  # query rows gathered at once by the torch path (memory: rows x keys x heads x D)


def as_decode_rows(rows: PrefillRows, block_size: int, first: int = 0) -> DecodeRows:
    """The prefill rows as decode rows: row t's block table is its request's, its length its
    position + 1 (bottom-right causal). Device ops only: no host read."""
    dev = rows.cu_q.device
    t = torch.arange(rows.tokens, device=dev, dtype=rows.cu_q.dtype)
    req = torch.searchsorted(rows.cu_q, t, right=True) - 1
    ctx = rows.cu_k[1:] - rows.cu_k[:-1]
    new = rows.cu_q[1:] - rows.cu_q[:-1]
    lens = (ctx[req] - new[req] + (t - rows.cu_q[req]) + 1).to(torch.int32)
    max_blocks = max(1, -(-rows.max_k // block_size))
    b = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_size
    idx = (rows.cu_k[req].long()[:, None] + b[None, :]).clamp_(max=max(rows.kv_index.numel() - 1, 0))
    tables = (rows.kv_index[idx] // block_size).to(torch.int32)  # entries past a row's length: never read
    return DecodeRows(first, tables.contiguous(), lens, 1)


def forward(out, q, k_cache, v_cache, batch: PagedBatch, scale: float, window=None, softcap=None, kernels=None):
    """Both parts of a step into out, every row in the per-row order. kernels: ops.paged_decode's
    module when the CUDA kernel serves this shape, else None (the torch path)."""
    block_size = k_cache.shape[1]
    parts = []
    if batch.prefill is not None and batch.prefill.tokens:
        parts.append(as_decode_rows(batch.prefill, block_size))
    if batch.decode is not None:
        parts.append(batch.decode)
    for rows in parts:
        n = rows.context_lens.shape[0]
        o, qr = out[rows.first : rows.first + n], q[rows.first : rows.first + n]
        if kernels is not None:
            kernels.paged_decode(
                o, qr, k_cache, v_cache, rows.block_tables, rows.context_lens, scale, 1, window, softcap
            )
        else:
            rows_forward(o, qr, k_cache, v_cache, rows.block_tables, rows.context_lens, scale, window, softcap)
    return out


def rows_forward(out, q, k_cache, v_cache, tables, lens, scale: float, window=None, softcap=None):
    """out[s] = softmax(q[s] K_s^T * scale) V_s over the first lens[s] keys of table s (the last
    `window` of them), computed in fp32 (float64 for float64 q) in the chunked order above."""
    for lo in range(0, q.shape[0], ROW_TILE):
        hi = min(lo + ROW_TILE, q.shape[0])
        out[lo:hi] = _tile(q[lo:hi], k_cache, v_cache, tables[lo:hi], lens[lo:hi], scale, window, softcap).to(out.dtype)
    return out


def _tile(q, k_cache, v_cache, tables, lens, scale, window, softcap):
    n, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    longest = int(lens.max()) if n else 0
    chunks = max(1, -(-longest // KEY_CHUNK))
    keys = chunks * KEY_CHUNK
    slot = torch.arange(keys, device=q.device)
    blocks = tables.long()[:, (slot // block_size).clamp(max=tables.shape[1] - 1)]  # [n, keys]
    flat = blocks * block_size + slot % block_size
    pos = lens.long()[:, None] - 1  # the query's position
    visible = (slot[None, :] <= pos) & (slot[None, :] < lens.long()[:, None])
    if window is not None:
        visible &= slot[None, :] > pos - window
    kf = k_cache.view(-1, kv_heads, d)[flat].to(dtype)  # [n, keys, kv_heads, D]
    vf = v_cache.view(-1, kv_heads, d)[flat].to(dtype)
    kf = kf.masked_fill(~visible[:, :, None, None], 0)  # padding slots may hold anything: zeros
    vf = vf.masked_fill(~visible[:, :, None, None], 0)
    qf = q.to(dtype).view(n, 1, kv_heads, group, d)
    s = (qf * kf[:, :, :, None, :]).sum(-1) * scale  # [n, keys, kv_heads, group]: sums over D alone
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.permute(0, 2, 3, 1).masked_fill(~visible[:, None, None, :], float("-inf"))  # [n, kvh, g, keys]
    m = s.amax(-1, keepdim=True).clamp(min=torch.finfo(dtype).min)  # exact in any order
    p = torch.exp(s - m).contiguous()  # masked: 0
    p_chunks = p.view(n, kv_heads, group, chunks, KEY_CHUNK)
    v_chunks = vf.permute(0, 2, 3, 1).reshape(n, kv_heads, 1, d, chunks, KEY_CHUNK)  # [n, kvh, 1, D, c, K]
    denom = torch.zeros(n, kv_heads, group, dtype=dtype, device=q.device)
    acc = torch.zeros(n, kv_heads, group, d, dtype=dtype, device=q.device)
    for c in range(chunks):  # chunk by chunk, left to right: a fixed order
        pc = p_chunks[:, :, :, c]  # [n, kvh, g, K]
        denom = denom + pc.sum(-1)
        acc = acc + (pc[:, :, :, None, :] * v_chunks[:, :, :, :, c]).sum(-1)
    o = acc / denom.clamp(min=torch.finfo(dtype).tiny)[..., None]
    o = torch.where(lens.view(n, 1, 1, 1) > 0, o, 0)
    return o.reshape(n, heads, d)
