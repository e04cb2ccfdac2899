"""Attention over the paged KV cache, one step format on every device: a `PagedBatch`
(ops/paged_attention.py) built once per step by app/engine/batch.py and reused by every layer.

On CUDA, shapes the kernels serve (ops/paged_decode.py's `supported`) run on them
(ops/paged_attention.py); everything else (the CPU; on CUDA, head layouts and page sizes the kernels
lack) runs the fp32 torch reference (ops/paged_reference.py), which defines what both compute.
"""

import contextlib

from . import fixed_attention, fixed_order
from . import paged_attention as kernels
from . import paged_reference as reference

_split = None  # while set (split_at_attention), it runs in place of every attention call


@contextlib.contextmanager
def split_at_attention(fn):
    """Inside this block every `paged_attention` call is `fn(out, q, k_cache, v_cache, batch, scale,
    window, softcap)` instead: app/engine/mixed_graphs.py captures a forward as CUDA graphs of the
    pieces between its attention calls, the model unchanged."""
    global _split
    before, _split = _split, fn
    try:
        yield
    finally:
        _split = before


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k_cache/v_cache[slot_mapping[t]] = k/v[t], in place.

    caches: [blocks, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    slot_mapping: [tokens] int flat slot (block * block_size + offset).
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def _on_kernels(q, k_cache) -> bool:
    """Whether the CUDA kernels serve attention of q over this cache."""
    _, heads, d = q.shape
    return q.is_cuda and kernels.supported(q.dtype, d, heads, k_cache.shape[2], k_cache.shape[1])


def paged_attention(out, q, k_cache, v_cache, batch: kernels.PagedBatch, scale, window=None, softcap=None):
    """out[t] = softmax(q[t] K^T * scale) V over the visible keys of token t's own sequence.

    out: [tokens, heads, head_dim] written in place; q: [tokens, heads, head_dim];
    caches: [blocks, block_size, kv_heads, head_dim] (already holding this step's KV).
    Grouped-query attention: heads is a multiple of kv_heads. window: keys p - window < k <= p
    only (None: all k <= p); softcap: scores = softcap * tanh(scores / softcap) (None: none).
    """
    if _split is not None:
        return _split(out, q, k_cache, v_cache, batch, scale, window, softcap)
    if fixed_order.current().attention == "per_row":  # one reduction order per row (ops/fixed_attention.py)
        on_kernels = _on_kernels(q, k_cache)
        if q.is_cuda and not on_kernels:  # torch's CUDA reductions pick their order by tensor size
            raise ValueError(f"no fixed-order attention on CUDA for {q.dtype}, head_dim {q.shape[2]}")
        return fixed_attention.forward(
            out, q, k_cache, v_cache, batch, scale, window, softcap, kernels if on_kernels else None
        )
    path = kernels if _on_kernels(q, k_cache) else reference
    return path.forward(out, q, k_cache, v_cache, batch, scale, window, softcap)
