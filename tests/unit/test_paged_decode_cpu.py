"""The paged decode kernel's own source (ops/kernels/attention.cu) run on the CPU, against an fp32
reference: CUDA's threads, warp shuffles, the m16n8k16 MMA and cp.async stand in as fibers
(tests/support/cpu_cuda/). CI has no GPU; this checks the kernel's fragment layouts, online softmax,
splits merged by the last block, windows and soft-capping, with copies landing at their wait or
at once. tests/gpu/test_paged_attention_gpu.py checks the same on the device."""

import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch

from ops import paged_decode as pd

pytestmark = pytest.mark.slow  # g++ builds the kernel source for the CPU emulation

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the CPU stand-in")
    tmp = tmp_path_factory.mktemp("cpu_cuda")
    for f in [ROOT / "ops/kernels/attention.cu", *(ROOT / "tests/support/cpu_cuda").iterdir()]:
        shutil.copy(f, tmp)  # the stand-in headers shadow kernels/'s, which attention.cu includes by ""
    build = subprocess.run(
        ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", "decode.so", "decode_driver.cpp"],
        cwd=tmp,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    return ctypes.CDLL(str(tmp / "decode.so"))


def _tables(lens, bs, gen):
    """Random disjoint blocks for each sequence, rows wider than needed; [seqs, width] int32."""
    blocks = sum(-(-n // bs) for n in lens) + 3
    perm = torch.randperm(blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(-(-n // bs) for n in lens) + 2, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        tables[i, : -(-n // bs)] = perm[at : at + -(-n // bs)]
        at += -(-n // bs)
    return blocks, tables


def _reference(q, k, v, tables, lens, scale, window, softcap):
    """fp32 attention of each sequence's query over its visible context; [seqs, heads, D]."""
    bs, kv_heads, d = k.shape[1:]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        idx = torch.arange(max(0, n - window) if window else 0, n)
        rows = tables[i, idx // bs].long() * bs + idx % bs
        kk = k.view(-1, kv_heads, d)[rows].float().repeat_interleave(group, 1)
        vv = v.view(-1, kv_heads, d)[rows].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)
    return out


def _run(lib, dtype, d, group, lens, splits, config, bs=16, window=None, softcap=None, defer=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    heads = kv_heads * group
    blocks, tables = _tables(lens, bs, gen)
    k = torch.randn(blocks, bs, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, d, generator=gen).to(dtype)
    q = (2 * torch.randn(len(lens), heads + 1, d, generator=gen)).to(dtype)[:, :heads]  # a row stride of its own
    out = torch.full((len(lens), heads + 2, d), float("nan"), dtype=dtype)[:, 1 : heads + 1]
    ctx = torch.tensor(lens, dtype=torch.int32)
    part_acc = torch.full((len(lens) * heads * splits * d,), float("nan"))
    part_ml = torch.full((len(lens) * heads * splits * 2,), float("nan"))
    counters = torch.zeros(len(lens) * kv_heads, dtype=torch.int32)
    args = pd._DecodeArgs(
        q=q.data_ptr(),
        out=out.data_ptr(),
        k_cache=k.data_ptr(),
        v_cache=v.data_ptr(),
        block_tables=tables.data_ptr(),
        context_lens=ctx.data_ptr(),
        part_acc=part_acc.data_ptr(),
        part_ml=part_ml.data_ptr(),
        counters=counters.data_ptr(),
        q_stride=q.stride(0),
        out_stride=out.stride(0),
        table_stride=tables.stride(0),
        heads=heads,
        kv_heads=kv_heads,
        group=group,
        block_size=bs,
        splits=splits,
        scale=d**-0.5,
        window=window or 0,
        softcap=softcap or 0.0,
    )
    assert lib.run(ctypes.byref(args), len(lens), int(dtype == torch.bfloat16), d, *config, int(defer), seed) == 0
    assert counters.eq(0).all()  # the last split of each pair reset its counter
    return out, _reference(q, k, v, tables, lens, d**-0.5, window, softcap)


LENS = [1, 15, 16, 17, 33, 130, 0, 257]  # partial tiles, one of each page size, a padding row


@pytest.mark.parametrize(
    "dtype, d, group, splits, bs, window, softcap, defer",
    [
        (torch.float16, 128, 4, 1, 16, None, None, True),
        (torch.bfloat16, 128, 8, 3, 32, None, None, False),
        (torch.float16, 96, 1, 2, 16, 40, None, True),  # Phi-3: the last V round half empty
        (torch.bfloat16, 256, 2, 2, 16, 40, 3.0, True),  # Gemma 2: window and soft-cap
        (torch.float16, 256, 8, 5, 32, None, 2.0, False),
        (torch.bfloat16, 64, 3, 1, 16, 100, None, False),
        (torch.float16, 64, 7, 4, 16, None, None, True),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_kernel_source_matches_fp32(lib, dtype, d, group, splits, bs, window, softcap, defer):
    config = (pd.WARPS, pd.stages(d, 90))
    out, ref = _run(lib, dtype, d, group, LENS, splits, config, bs, window, softcap, defer, seed=d + group)
    assert out[LENS.index(0)].eq(0).all()
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < (2e-3 if dtype == torch.float16 else 1e-2), err  # measured: 3e-4 and 2.3e-3


@pytest.mark.parametrize("d, config, splits", [(128, (2, 2), 1), (256, (4, 2), 1), (128, (8, 2), 2)])
def test_long_contexts_refill_the_table_ring(lib, d, config, splits):
    """Warps past 32 tiles (each lane holds one tile's block-table entry); sm_80's head dim 256;
    8 warps a block."""
    out, ref = _run(lib, torch.float16, d, 4, [2100, 5], splits, config, seed=3)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-3


def test_shared_memory_mirror(lib):
    lib.smem_size.restype = ctypes.c_uint
    for d, w, s in ((64, 4, 4), (96, 4, 3), (128, 4, 3), (128, 2, 2), (128, 8, 2), (256, 4, 3), (256, 4, 2)):
        assert lib.smem_size(d, w, s) == pd.smem_bytes(d, w, s)
