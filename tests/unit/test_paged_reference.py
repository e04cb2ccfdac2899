"""The torch reference of paged attention (ops/paged_reference.py, the CPU's attention) against
attention written out one query at a time: prefill requests over earlier cached context and
decode rows over random block tables in one PagedBatch, GQA, sliding windows, soft-capping,
a padding row of length 0, bf16 in and out."""

import pytest
import torch

from ops import paged_attention as pa
from ops import paged_reference as ref

BS = 4


def _one_query(q, k, v, pos, scale, window, softcap):
    """q [heads, D] at position pos over k, v [context, kv_heads, D], in float64."""
    group = q.shape[0] // k.shape[1]
    keys = torch.arange(k.shape[0])
    seen = (keys <= pos) & ((keys > pos - window) if window else True)
    kk, vv = k[seen].double().repeat_interleave(group, 1), v[seen].double().repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)


def _case(prefill, decode_lens, heads, kv_heads, d, dtype, seed):
    """A cache holding every request's context in shuffled blocks, q for prefill then decode rows,
    the PagedBatch, and each row's (block table, context length, position)."""
    g = torch.Generator().manual_seed(seed)
    contexts = [a + n for a, n in prefill] + decode_lens
    blocks = sum(-(-c // BS) for c in contexts) + 2
    perm, at, tables = torch.randperm(blocks, generator=g).tolist(), 0, []
    for c in contexts:
        tables.append(perm[at : at + -(-c // BS)])
        at += len(tables[-1])
    k = torch.randn(blocks, BS, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(blocks, BS, kv_heads, d, generator=g).to(dtype)
    tokens = sum(n for _, n in prefill) + len(decode_lens)
    q = (2 * torch.randn(tokens, heads, d, generator=g)).to(dtype)
    slots = lambda t, c: [t[p // BS] * BS + p % BS for p in range(c)]  # noqa: E731
    cu_q, cu_k, kv_index, rows = [0], [0], [], []
    for (a, n), t in zip(prefill, tables):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + a + n)
        kv_index += slots(t, a + n)
        rows += [(t, a + n, a + i) for i in range(n)]
    pre = pa.PrefillRows(
        cu_q[-1],
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        torch.tensor(kv_index),
        max(n for _, n in prefill),
        max(cu_k[i + 1] - cu_k[i] for i in range(len(prefill))),
    )
    dec_tables = tables[len(prefill) :]
    width = max(len(t) for t in dec_tables) + 1  # wider than needed, as a CUDA graph's tables are
    padded = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.int32)
    dec = pa.DecodeRows(cu_q[-1], padded, torch.tensor(decode_lens, dtype=torch.int32), 1)
    rows += [(t, c, c - 1) for t, c in zip(dec_tables, decode_lens)]
    return q, k, v, pa.PagedBatch(pre, dec), rows


@pytest.mark.parametrize(
    "heads, kv_heads, d, window, softcap, dtype",
    [
        (6, 2, 16, None, None, torch.float32),  # GQA
        (4, 4, 8, 5, None, torch.float32),  # Mistral-like sliding window
        (8, 2, 16, 6, 3.0, torch.float32),  # Gemma 2: window and soft-capping
        (4, 1, 16, None, 2.0, torch.bfloat16),
    ],
)
def test_reference_equals_attention_one_query_at_a_time(heads, kv_heads, d, window, softcap, dtype):
    prefill = [(0, 9), (6, 3), (0, 1), (13, 2)]  # (tokens already cached, new tokens)
    decode_lens = [1, 4, 5, 0, 17]  # one block exactly, partial blocks, a padding row
    q, k, v, batch, rows = _case(prefill, decode_lens, heads, kv_heads, d, dtype, seed=d + heads)
    out = torch.full_like(q, float("nan"))
    ref.forward(out, q, k, v, batch, d**-0.5, window, softcap)
    kf, vf = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    for t, (table, context, pos) in enumerate(rows):
        if context == 0:
            assert out[t].eq(0).all(), "a row of length 0 gets zeros"
            continue
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(context)])
        want = _one_query(q[t], kf[slots], vf[slots], pos, d**-0.5, window, softcap)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[t].double(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_reference_prefill_equals_the_cuda_paths_softcapped_prefill():
    """The CUDA path's soft-capped prefill (torch ops: it runs here) computes what the reference does."""
    q, k, v, batch, _ = _case([(0, 7), (5, 4)], [3], 8, 2, 16, torch.float32, seed=1)
    ours, theirs = torch.zeros_like(q), torch.zeros_like(q)
    ref.prefill(ours, q, k, v, batch.prefill, 0.25, 4, 2.5)
    pa.prefill_varlen(theirs, q, k, v, batch.prefill, 0.25, 4, 2.5)
    torch.testing.assert_close(ours[: batch.prefill.tokens], theirs[: batch.prefill.tokens], rtol=1e-5, atol=1e-5)
