"""The soft-capped, windowed prefill attention of the CUDA path (torch ops only, so it runs on
the CPU too) against a per-request fp32 reference."""

import torch

from ops import paged_attention as pa


def test_softcapped_prefill_sees_only_its_request_and_window():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, window, softcap = 6, 2, 16, 5, 2.0
    reqs = [(0, 9), (7, 4), (0, 1)]  # (tokens already cached, new tokens)
    cu_q, cu_k = [0], [0]
    for a, n in reqs:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + a + n)
    q = torch.randn(cu_q[-1], heads, d, generator=g) * 2
    k, v = torch.randn(cu_k[-1], kv_heads, d, generator=g), torch.randn(cu_k[-1], kv_heads, d, generator=g)
    rows = pa.PrefillRows(
        cu_q[-1],
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        torch.arange(cu_k[-1]),
        9,
        11,
    )
    out = torch.full_like(q, float("nan"))
    pa.prefill_varlen(out, q, k.view(-1, 1, kv_heads, d), v.view(-1, 1, kv_heads, d), rows, d**-0.5, window, softcap)
    for i, (a, n) in enumerate(reqs):
        qq = q[cu_q[i] : cu_q[i + 1]]
        kk = k[cu_k[i] : cu_k[i + 1]].repeat_interleave(heads // kv_heads, 1)
        vv = v[cu_k[i] : cu_k[i + 1]].repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("thd,nhd->htn", qq, kk) * d**-0.5
        s = torch.tanh(s / softcap) * softcap
        pos_q, pos_k = a + torch.arange(n)[:, None], torch.arange(a + n)[None, :]
        s = s.masked_fill(~((pos_k <= pos_q) & (pos_k > pos_q - window)), float("-inf"))
        ref = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), vv)
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], ref, rtol=1e-5, atol=1e-5)
