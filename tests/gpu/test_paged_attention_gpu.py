"""The CUDA attention path and small ops against fp32 torch references: paged decode over random
block tables (lengths 1..4096, GQA groups 1..8, head dims 64/96/128/256, fp16/bf16, windows and
soft-capping, the sm_80 build, block size 32, CUDA graph replays at new lengths), varlen prefill
with earlier context, RMSNorm(+residual), SwiGLU, RoPE + KV write."""

import pytest
import torch
import torch.nn.functional as F

from ops import paged_attention as pa
from ops import paged_decode as pd
from ops import small_ops
from ops.norms import rms_norm
from ops.paged_attention import PrefillRows
from ops.rope import apply_rope

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16]
BS = 16
LENS = [1, 2, 15, 16, 17, 255, 511, 512, 513, 1000, 2048, 4096, 0, 3000]


def paged_cache(blocks, kv_heads, d, dtype, gen, bs=BS):
    k = torch.randn(blocks, bs, kv_heads, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, d, device="cuda", generator=gen).to(dtype)
    return k, v


def block_tables(lens, blocks, gen, bs=BS):
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    need = sum(-(-n // bs) for n in lens)
    assert need <= blocks
    tables, at = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda"), 0
    for i, n in enumerate(lens):
        m = -(-n // bs)
        tables[i, :m] = perm[at : at + m]
        at += m
    return tables


def _ref_decode(q, k, v, tables, lens, scale, window=None, softcap=None):
    """fp32: each sequence's (visible) context gathered, softmax attention of its one query per head."""
    heads, bs, kv_heads = q.shape[1], k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        idx = torch.arange(max(0, n - window) if window else 0, n, device=q.device)
        rows = tables[i, idx // bs].long() * bs + idx % bs
        kk = k.view(-1, kv_heads, k.shape[-1])[rows].float().repeat_interleave(heads // kv_heads, 1)
        vv = v.view(-1, kv_heads, v.shape[-1])[rows].float().repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv)
    return out


def rel_err(a, b):
    return float((a.float() - b).norm() / b.norm().clamp(min=1e-6))


def _tol(dtype):
    return 5e-3 if dtype == torch.float16 else 2e-2


def _decode_case(dtype, d, group, lens, seed, bs=BS, q_scale=1.0):
    """Random q [seqs, heads, D] (a row stride of its own), caches, tables, lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads = 2 if group >= 4 else 4
    blocks = sum(-(-n // bs) for n in lens) + 7
    k, v = paged_cache(blocks, kv_heads, d, dtype, gen, bs)
    tables = block_tables([max(n, 1) for n in lens], blocks, gen, bs)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = (q_scale * torch.randn(len(lens), kv_heads * group + 1, d, device="cuda", generator=gen)).to(dtype)
    return q[:, : kv_heads * group], k, v, tables, ctx


def _check(out, ref, lens, dtype, what):
    assert not out.isnan().any(), what
    assert rel_err(out, ref) < _tol(dtype), (what, rel_err(out, ref))
    assert all(out[i].abs().max() == 0 for i, n in enumerate(lens) if n == 0), what  # padding rows: zeros


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", pd.HEAD_DIMS)
@pytest.mark.parametrize("group", range(1, pd.MAX_GROUP + 1))
def test_paged_decode_matches_fp32(dtype, d, group):
    q, k, v, tables, ctx = _decode_case(dtype, d, group, LENS, 100 * d + group)
    ref = _ref_decode(q, k, v, tables, LENS, d**-0.5)
    for splits in sorted({1, 3, pd.decode_splits(len(LENS), k.shape[2], "cuda")}):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode(out, q, k, v, tables, ctx, d**-0.5, splits)
        _check(out, ref, LENS, dtype, f"splits {splits}")
    assert pd._counters(torch.cuda.current_device()).eq(0).all()  # each pair's last split reset its counter


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d, group", [(96, 1), (96, 4), (256, 2), (256, 8), (128, 3), (64, 8)])
@pytest.mark.parametrize("window, softcap", [(100, None), (None, 2.0), (64, 1.5)])  # scores ~N(0, 3): caps bite
def test_paged_decode_window_and_softcap(dtype, d, group, window, softcap):
    lens = [1, 50, 99, 100, 101, 700, 2048, 0]
    q, k, v, tables, ctx = _decode_case(dtype, d, group, lens, d * group, q_scale=3.0)
    ref = _ref_decode(q, k, v, tables, lens, d**-0.5, window, softcap)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode(out, q, k, v, tables, ctx, d**-0.5, splits, window, softcap)
        _check(out, ref, lens, dtype, f"splits {splits}")


@pytest.mark.parametrize("d", pd.HEAD_DIMS)
def test_paged_decode_sm80_build_and_other_shapes(d):
    """sm_80's build (as PTX the driver compiles here; head dim 256 two stages deep), 32-token
    pages, and the other (warps, stages) the benchmark times."""
    dtype, group = torch.bfloat16, 4
    configs = [dict(config=c) for c in pd.variants(d, 90) if c != (pd.WARPS, pd.stages(d, 90))]
    for bs, kw in [(BS, dict(arch=80)), (32, {})] + [(BS, c) for c in configs]:
        q, k, v, tables, ctx = _decode_case(dtype, d, group, LENS, d + bs, bs=bs)
        ref = _ref_decode(q, k, v, tables, LENS, d**-0.5)
        for splits in (1, 4):
            out = torch.full_like(q, float("nan"))
            pa.paged_decode(out, q, k, v, tables, ctx, d**-0.5, splits, **kw)
            _check(out, ref, LENS, dtype, f"{bs} {kw} splits {splits}")


def test_paged_decode_graph_replays_at_new_lengths():
    """One capture (splits > 1: partials and counters), replayed over new lengths, tables and
    queries written into its inputs: each replay equals the reference."""
    dtype, d, group = torch.float16, 128, 4
    q, k, v, tables, ctx = _decode_case(dtype, d, group, LENS, 5)
    splits = 4
    out = torch.empty_like(q)
    pa.paged_decode(out, q, k, v, tables, ctx, d**-0.5, splits)  # compiled, counters allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode(out, q, k, v, tables, ctx, d**-0.5, splits)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(3):
        lens = torch.randint(0, 4097, (len(LENS),), generator=gen, device="cuda").tolist()
        tables.random_(0, k.shape[0], generator=gen)  # blocks shared between sequences: reads only
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(dtype))
        graph.replay()
        _check(out, _ref_decode(q, k, v, tables, lens, d**-0.5), lens, dtype, lens)


def prefill_rows(reqs, heads, kv_heads, d, dtype, gen):
    """Random q and caches for requests (tokens already cached, new tokens): q, k, v, PrefillRows,
    the query row offsets and each request's context slots."""
    blocks = sum(-(-(a + n) // BS) for a, n in reqs) + 3
    k, v = paged_cache(blocks, kv_heads, d, dtype, gen)
    tables = block_tables([a + n for a, n in reqs], blocks, gen)
    q = torch.randn(sum(n for _, n in reqs), heads, d, device="cuda", generator=gen).to(dtype)
    cu_q, cu_k, kv_index = [0], [0], []
    for i, (a, n) in enumerate(reqs):
        idx = torch.arange(a + n, device="cuda")
        kv_index.append(tables[i, idx // BS].long() * BS + idx % BS)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + a + n)
    t32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    rows = PrefillRows(
        cu_q[-1], t32(cu_q), t32(cu_k), torch.cat(kv_index), max(n for _, n in reqs), max(a + n for a, n in reqs)
    )
    return q, k, v, rows, cu_q, kv_index


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_prefill_varlen_causal_over_earlier_context(dtype):
    """Requests with and without earlier context (chunked prefill): each new query sees its
    request's earlier tokens and its own prefix."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    heads, kv_heads, d = 8, 2, 128
    reqs = [(0, 37), (20, 50), (300, 128), (0, 2)]  # (tokens already cached, new tokens)
    q, k, v, rows, cu_q, kv_index = prefill_rows(reqs, heads, kv_heads, d, dtype, gen)
    out = torch.full_like(q, float("nan"))
    pa.prefill_varlen(out, q, k, v, rows, d**-0.5)
    for i, (a, n) in enumerate(reqs):
        kk = k.view(-1, kv_heads, d)[kv_index[i]].float().repeat_interleave(4, 1).transpose(0, 1)
        vv = v.view(-1, kv_heads, d)[kv_index[i]].float().repeat_interleave(4, 1).transpose(0, 1)
        qq = q[cu_q[i] : cu_q[i + 1]].float().transpose(0, 1)
        mask = torch.arange(a + n, device="cuda")[None, :] <= (a + torch.arange(n, device="cuda"))[:, None]
        ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=d**-0.5).transpose(0, 1)
        assert rel_err(out[cu_q[i] : cu_q[i + 1]], ref) < 2e-2, (i, rel_err(out[cu_q[i] : cu_q[i + 1]], ref))


def _ulps(a, b):
    """Largest difference in units of the dtype's last place, at b's magnitude."""
    eps = torch.finfo(a.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs().clamp(min=1e-3) * eps)).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_small_ops_round_as_the_torch_ops(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    t, hidden, inter = 37, 4096, 11008
    h = torch.randn(t, hidden, device="cuda", generator=gen).to(dtype)
    delta = torch.randn(t, hidden, device="cuda", generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)

    def torch_norm(x):
        y = x.float()
        return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    assert _ulps(small_ops.rms_norm(h, w, 1e-5), torch_norm(h)) <= 1
    h2 = h.clone()
    out = small_ops.rms_norm(h2, w, 1e-5, delta)
    assert torch.equal(h2, h + delta) and _ulps(out, torch_norm(h + delta)) <= 1
    assert _ulps(rms_norm(h, w, 1e-5), torch_norm(h)) <= 1
    gu = torch.randn(t, 2 * inter, device="cuda", generator=gen).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert _ulps(small_ops.silu_mul(gu), F.silu(gate) * up) <= 1

    heads, kv_heads, d = 8, 2, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device="cuda", generator=gen).to(dtype)
    pos = torch.randint(0, 4000, (t,), device="cuda", generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    from ops.rope import rope_cos_sin

    cos, sin = rope_cos_sin(pos, inv, 1.0, dtype)
    kc = torch.zeros(8, BS, kv_heads, d, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(8 * BS, device="cuda", generator=gen)[:t].to(torch.int32)
    slots[5] = -1  # not written
    ref = qkv.clone()
    q_ref = apply_rope(ref[:, : heads * d].view(t, heads, d), cos, sin)
    k_ref = apply_rope(ref[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), cos, sin)
    v_ref = ref[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    small_ops.rope_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, d)
    assert torch.equal(qkv[:, : heads * d].view(t, heads, d), q_ref)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, kv_heads, d)[slots[keep].long()], k_ref[keep])
    assert torch.equal(vc.view(-1, kv_heads, d)[slots[keep].long()], v_ref[keep])
    assert int((kc.view(-1, kv_heads, d).abs().sum((1, 2)) > 0).sum()) == int(keep.sum())
