"""Attention over the paged KV cache on CUDA, without a padded copy of the KV.

Decode rows (one query each): `paged_decode` (ops/paged_decode.py), our NVRTC kernel
(kernels/attention.cu): a block per (sequence, KV head, split) reads each K/V byte once for the
whole GQA group (up to 8 query heads), each warp streaming 16-token tiles through its own
cp.async ring into tensor-core MMAs; splits of one (sequence, KV head) are merged by whichever of
their blocks finishes last, in the same launch. Its grid depends on the batch shape only, so a
CUDA graph serves any context lengths. Prefill rows (a request's new tokens, causal over its whole context): the context's KV
gathered into one varlen buffer, then one FlashAttention-2 varlen call (torch's, bottom-right
causal), all prefill requests in one launch each. Prompts are read once per step there while
every decode step re-reads the whole context, so the gather costs a decode step's KV bytes
once per prefill step: CUDA C++ is spent where the bytes are.

Measured: benchmarks/attention.py → benchmarks/results/attention_h200.json; docs/gpu_engine.md
has the figures and what was tried.

Layouts: caches [blocks, block_size, kv_heads, D] fp16/bf16, block_size a multiple of 16; q, out
[tokens, heads, D]; block tables int32 [seqs, >= max blocks]; lengths int32. Nothing here reads
device memory on the host or synchronizes.
"""

from dataclasses import dataclass

import torch

from .paged_decode import decode_splits, paged_decode, supported, warm_up  # noqa: F401 (the engine's names)


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


def prefill_varlen(
    out, q, k_cache, v_cache, rows: PrefillRows, scale: float, window: int | None = None, softcap: float | None = None
):
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
    o = torch.ops.aten._flash_attention_forward(
        q[: rows.tokens], k, v, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, True, False, scale=scale, **sliding
    )[0]
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


def forward(
    out, q, k_cache, v_cache, batch: PagedBatch, scale: float, window: int | None = None, softcap: float | None = None
):
    """Both parts of a step (prefill rows first, then decode rows) into out."""
    if batch.prefill is not None:
        prefill_varlen(out, q, k_cache, v_cache, batch.prefill, scale, window, softcap)
    if batch.decode is not None:
        dec = batch.decode
        n = dec.context_lens.shape[0]
        paged_decode(
            out[dec.first : dec.first + n],
            q[dec.first : dec.first + n],
            k_cache,
            v_cache,
            dec.block_tables,
            dec.context_lens,
            scale,
            dec.splits,
            window,
            softcap,
        )
    return out
