"""Attention over the paged KV cache on CUDA, without a padded copy of the KV.

Decode rows (one query each): `paged_decode`, our NVRTC kernel (kernels/attention.cu): a block
per (sequence, KV head, split) reads each K/V row once for the whole GQA group through the
block table; its grid depends on the batch shape only, so a CUDA graph serves any context
lengths. Prefill rows (a request's new tokens, causal over its whole context): the context's
KV gathered into one varlen buffer, then one FlashAttention-2 varlen call (torch's, bottom-right
causal), all prefill requests in one launch each. Prompts are read once per step there while
every decode step re-reads the whole context, so the gather costs a decode step's KV bytes
once per prefill step: CUDA C++ is spent where the bytes are.

Measured (H200, benchmarks/results/attention_h200.json, 32 sequences, fp16, D 128): Llama-2-7B
heads (32 / 32 KV) 61 µs at context 256 to 707 µs at 4096, 1.92x to 1.39x the bytes over the
copy bandwidth; GQA 32 / 8 KV 36 to 308 µs (4.5x to 2.4x). vLLM's Triton unified_attention in
the same run is faster (51 to 564 µs; 25 to 241 µs), the gather + SDPA path this replaced
2.8x to 3.0x slower (1.8x to 2.0x with 8 KV heads). CUDA C++ was kept because its grid is a
function of the batch shape only (one graph per batch bucket) and it compiles in CI; the gap to
vLLM is open work. decode_splits' count is within 0.90x to 1.13x of the best of 1, 2, 4 and 8
splits at every context measured (no fixed count is best at both short and long contexts); 16-byte
V loads for groups of 1-2 heads were slower (80 registers instead of 64: 65.8 against 61.2 µs at
context 256; docs/gpu_engine.md).

Layouts: caches [blocks, block_size, kv_heads, D] fp16/bf16; q, out [tokens, heads, D];
block tables int32 [seqs, >= max blocks]; lengths int32. Nothing here reads device memory on
the host or synchronizes.
"""
import ctypes
import functools
from dataclasses import dataclass

import torch

PART = 512  # most tokens per partition (kPart in kernels/attention.cu)
HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 4, 5, 6, 7, 8)  # query heads per KV head (Qwen2.5: 5, 6 and 7)
_CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


class _DecodeArgs(ctypes.Structure):
    """Mirror of `DecodeArgs` in kernels/attention.cu."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "out", "k_cache", "v_cache", "block_tables", "context_lens",
                                                "part_acc", "part_ml")]
    _fields_ += [(n, ctypes.c_longlong) for n in ("q_stride", "out_stride")]
    _fields_ += [(n, ctypes.c_int) for n in ("table_stride", "heads", "kv_heads", "block_size", "splits")]
    _fields_ += [("scale", ctypes.c_float), ("window", ctypes.c_int), ("softcap", ctypes.c_float)]


@dataclass(frozen=True)
class DecodeRows:
    """Rows first .. first + n of the step, one query each (graphs pad n with length-0 rows)."""

    first: int
    block_tables: torch.Tensor  # [n, max_blocks] int32
    context_lens: torch.Tensor  # [n] int32, this step's token included
    splits: int  # grid.z: see decode_splits


@dataclass(frozen=True)
class PrefillRows:
    """Rows 0 .. tokens of the step: requests' new tokens, each causal over its whole context."""

    tokens: int
    cu_q: torch.Tensor  # [requests + 1] int32 query row offsets
    cu_k: torch.Tensor  # [requests + 1] int32 offsets into kv_index
    kv_index: torch.Tensor  # [sum of contexts] int64 flat cache slot of each context token
    max_q: int
    max_k: int


@dataclass(frozen=True)
class PagedBatch:
    prefill: PrefillRows | None
    decode: DecodeRows | None


def supported(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> bool:
    return dtype in _CTYPE and head_dim in HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads in GROUPS


def kernel_names(dtype: torch.dtype, head_dim: int, group: int) -> tuple[str, str]:
    c = _CTYPE[dtype]
    return f"paged_decode_kernel<{c}, {head_dim}, {group}>", f"paged_decode_reduce<{c}, {head_dim}>"


def all_kernel_names() -> list[str]:
    """Every instantiation the wrapper can launch (CI compiles them for sm_80 and sm_90)."""
    return sorted({n for dt in _CTYPE for d in HEAD_DIMS for g in GROUPS for n in kernel_names(dt, d, g)})


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(seqs: int, kv_heads: int, device) -> int:
    """Splits per (sequence, KV head): enough blocks for ~8 per SM, at most 8; a function of the
    batch shape only (a captured graph keeps its grid)."""
    index = torch.device(device).index or 0
    return max(1, min(8, -(-8 * _sms(index) // (seqs * kv_heads))))


def _function(name: str, device: torch.device):
    from . import nvrtc  # not at import: CPU-only processes never load NVRTC

    index = torch.cuda.current_device() if device.index is None else device.index
    return nvrtc.load_function("attention.cu", name, index)


def paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale: float, splits: int,
                 window: int | None = None, softcap: float | None = None):
    """out[s, h] = softmax(q[s, h] · K[s]ᵀ · scale) · V[s] over the first context_lens[s] tokens
    of sequence s's blocks (the last `window` of them with a window), K/V head h // (heads /
    kv_heads); a row of length 0 gets zeros. softcap: scores softcap · tanh(score / softcap).

    out: [seqs, heads, D] written in place (row stride free, unit elsewhere); q: [seqs, heads, D]
    alike; caches: [blocks, block_size, kv_heads, D] contiguous, q's dtype (fp16/bf16), D 64 or
    128; block_tables: [seqs, >= blocks used] int32 (row stride free); context_lens: [seqs] int32.
    splits > 1: per-split partials (fp32 scratch, allocated here) merged by a second launch.
    """
    seqs, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    if not supported(q.dtype, d, heads, kv_heads) or k_cache.dtype != q.dtype or not k_cache.is_contiguous():
        raise ValueError(f"paged_decode: unsupported {q.dtype}, head_dim {d}, heads {heads}/{kv_heads}")
    if q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError("q and out: heads contiguous within a row")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise TypeError("block_tables and context_lens must be int32, table rows unit-stride")
    if seqs == 0:
        return out
    part_acc = part_ml = None
    if splits > 1:
        part_acc = torch.empty(seqs * heads * splits * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(seqs * heads * splits * 2, dtype=torch.float32, device=q.device)
    args = _DecodeArgs(
        q=q.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        block_tables=block_tables.data_ptr(), context_lens=context_lens.data_ptr(),
        part_acc=None if part_acc is None else part_acc.data_ptr(),
        part_ml=None if part_ml is None else part_ml.data_ptr(),
        q_stride=q.stride(0), out_stride=out.stride(0), table_stride=block_tables.stride(0), heads=heads,
        kv_heads=kv_heads, block_size=k_cache.shape[1], splits=splits, scale=scale, window=window or 0,
        softcap=softcap or 0.0,
    )
    main, reduce = kernel_names(q.dtype, d, heads // kv_heads)
    from .launch import launch

    launch(_function(main, q.device), seqs, 128, args, q.device, grid_y=kv_heads, grid_z=splits)
    if splits > 1:
        launch(_function(reduce, q.device), seqs, d, args, q.device, grid_y=heads)
    return out


def prefill_varlen(out, q, k_cache, v_cache, rows: PrefillRows, scale: float, window: int | None = None,
                   softcap: float | None = None):
    """out[t] = causal softmax attention of q[t] over its request's context (the context's last
    tokens are the request's rows, bottom-right aligned), for t < rows.tokens; with a window,
    over keys p - window < k <= p only; with softcap, the scores soft-capped first.

    out, q: [tokens, heads, D]; caches already hold this step's KV.
    """
    k = k_cache.view(-1, *k_cache.shape[2:])[rows.kv_index]  # [sum of contexts, kv_heads, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[rows.kv_index]
    if softcap is not None:  # FlashAttention-2 here has no soft-capping
        out[: rows.tokens] = _prefill_softcapped(q[: rows.tokens], k, v, rows, scale, window, softcap)
        return out
    sliding = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
    o = torch.ops.aten._flash_attention_forward(q[: rows.tokens], k, v, rows.cu_q, rows.cu_k, rows.max_q,
                                                rows.max_k, 0.0, True, False, scale=scale, **sliding)[0]
    out[: rows.tokens] = o
    return out


def _prefill_softcapped(q, k, v, rows: PrefillRows, scale: float, window: int | None, softcap: float):
    """Dense eager attention over all prefill rows at once (a request's rows see only its own keys),
    rounded as HF's eager Gemma 2; [tokens, heads, D]. Memory grows as tokens × contexts × heads."""
    cu_q, cu_k = rows.cu_q, rows.cu_k
    t = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype)
    j = torch.arange(k.shape[0], device=q.device, dtype=cu_k.dtype)
    req_q = torch.searchsorted(cu_q, t, right=True) - 1
    req_k = torch.searchsorted(cu_k, j, right=True) - 1
    past = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])  # context before each request's rows
    q_pos = t - cu_q[req_q] + past[req_q]
    k_pos = j - cu_k[req_k]
    visible = (req_q[:, None] == req_k[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).transpose(0, 1), v.repeat_interleave(group, dim=1).transpose(0, 1)
    s = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale  # [heads, tokens, contexts]
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ v).transpose(0, 1)


def warm_up(dtype: torch.dtype, head_dim: int, group: int, device) -> None:
    """Compile (or read from the disk cache) and load the decode kernels now."""
    for name in kernel_names(dtype, head_dim, group):
        _function(name, torch.device(device))


def forward(out, q, k_cache, v_cache, batch: PagedBatch, scale: float, window: int | None = None,
            softcap: float | None = None):
    """Both parts of a step (prefill rows first, then decode rows) into out."""
    if batch.prefill is not None:
        prefill_varlen(out, q, k_cache, v_cache, batch.prefill, scale, window, softcap)
    if batch.decode is not None:
        dec = batch.decode
        n = dec.context_lens.shape[0]
        paged_decode(out[dec.first : dec.first + n], q[dec.first : dec.first + n], k_cache, v_cache,
                     dec.block_tables, dec.context_lens, scale, dec.splits, window, softcap)
    return out
