"""CI (no GPU): every SGMV, paged decode attention and small-op kernel the wrappers can launch compiles
with NVRTC for sm_80 and sm_90, without spills."""

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from ops import nvrtc, sgmv_shapes

pytestmark = pytest.mark.slow  # NVRTC compiles every kernel for sm_80 and sm_90

ARCHS = (80, 90)
# NVRTC runs in spawned workers only: loading it into the pytest process broke the
# HTTP exchanges of later test modules (moto's S3 server answered BadStatusLine).
_SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def pool():
    """Two spawned workers for every compile of the module (one per core; started once)."""
    with ProcessPoolExecutor(2, mp_context=_SPAWN) as workers:
        yield workers


def _ptxas_report(source: str, name: str, arch: int) -> str:
    """ptxas' register / shared-memory / spill report for one kernel (compiled uncached)."""
    return nvrtc.compile_uncached(source, name, nvrtc.options(arch, ("--ptxas-options=-v",)))[2]


def _report(job):
    name, arch = job
    return name, arch, _ptxas_report("sgmv.cu", name, arch)


@pytest.fixture(scope="module")
def reports(pool):
    jobs = [(name, arch) for arch in ARCHS for name in sgmv_shapes.all_kernel_names(arch)]
    return list(pool.map(_report, jobs))


def test_every_kernel_compiles_without_spills(reports):
    assert len(reports) == sum(len(sgmv_shapes.all_kernel_names(a)) for a in ARCHS) >= 2 * 32
    for name, arch, log in reports:
        spills = re.search(r"(\d+) bytes spill stores", log)
        assert spills and spills.group(1) == "0", f"sm_{arch} {name} spills:\n{log}"


def test_the_engine_warm_up_asks_only_for_kernels_ci_compiles():
    for arch in ARCHS:
        every = set(sgmv_shapes.all_kernel_names(arch))
        for dtype in (torch.float16, torch.bfloat16):
            for max_rank in (1, 16, 33, 64, 128):
                names = sgmv_shapes.fused_kernel_names(dtype, max_rank, arch)
                assert names and set(names) <= every, (arch, dtype, max_rank)


def test_split_k_clusters_only_on_sm90():
    for arch in ARCHS:
        name, split, _, _ = sgmv_shapes.kernel_name(sgmv_shapes.FUSED, torch.float16, 16, 64, arch)
        assert ("cluster" in name) == (arch >= 90) and split == 8  # before sm_90: split-K through L2


def _compile_error() -> str:
    try:
        nvrtc.compile_kernel("sgmv.cu", "sgmv_kernel<int, 16, 1, 1, 0, float>", 90)
    except nvrtc.CompileError as exc:
        return str(exc)
    return ""


def test_compile_errors_carry_the_log(pool):
    assert re.search("sgmv_kernel<int", pool.submit(_compile_error).result())


def _compile_twice(cache_dir: str):
    before = os.environ.get("LORAPLEX_CACHE")
    os.environ["LORAPLEX_CACHE"] = cache_dir
    try:
        name = sgmv_shapes.kernel_name(sgmv_shapes.FUSED, torch.bfloat16, 32, 4096, 90)[0]
        compile_uncached = nvrtc.compile_kernel.__wrapped__
        first = compile_uncached("sgmv.cu", name, 90)
        return first, compile_uncached("sgmv.cu", name, 90)
    finally:  # the worker goes on compiling for other tests
        if before is None:
            del os.environ["LORAPLEX_CACHE"]
        else:
            os.environ["LORAPLEX_CACHE"] = before


def test_cubins_are_cached_on_disk(pool, tmp_path):
    (cubin, symbol), again = pool.submit(_compile_twice, str(tmp_path)).result()
    assert cubin[:4] == b"\x7fELF" and symbol.startswith("_Z")
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == 1  # under the cache, in its nvrtc/ folder
    assert again == (cubin, symbol)


def test_older_arch_builds_as_ptx():
    """load_function(..., arch=80) on a newer GPU runs this: PTX the driver compiles for it."""
    name = sgmv_shapes.kernel_name(sgmv_shapes.FUSED, torch.float16, 64, 16, 80)[0]
    ptx, symbol = nvrtc.compile_kernel("sgmv.cu", name, 80, ptx=True)
    text = ptx.rstrip(b"\0").decode()
    assert ".target sm_80" in text and f".entry {symbol}(" in text


def test_split_k_through_l2_only_for_grids_the_gpu_holds():
    """Before sm_90 the blocks of an item wait for each other: a grid that splits K must fit the
    GPU at once (MINB in kernels/sgmv.cu: 3 blocks of 16-row items per SM, 2 of 32-row)."""
    splits = set()
    for rows, minb in ((16, 3), (32, 2)):
        for items in range(1, 400):
            split, _, _ = sgmv_shapes.fused_shape(items, rows, 64, 80, 108)
            splits.add(split)
            assert split == 1 or items * split <= min(minb, sgmv_shapes.GX_PER_SM[rows]) * 108, (rows, items, split)
    assert splits == {1, 4, 8, 16}


def test_rank_groups_only_for_few_items_and_kernels_ci_compiles():
    """Rank groups (clusters of an item waiting for each other on sm_90): picked only for grids of
    at most 4 items at rank tiles 64 (items of 8+ rows on average) and 128, and only as kernels
    all_kernel_names lists; other shapes asked for are refused, not compiled on the fly."""
    compiled = set(sgmv_shapes.all_kernel_names(90))
    for max_rank in (16, 32, 64, 100, 128):
        for items, tokens in ((1, 1), (1, 16), (3, 48), (4, 4), (4, 64), (5, 80), (40, 40)):
            split, warps, groups = sgmv_shapes.fused_shape(items, 16, max_rank, 90, 132, tokens)
            grouped = max_rank > 64 and items <= 4 or max_rank > 32 and items <= 4 and tokens >= 8 * items
            assert (groups > 1) == grouped, (max_rank, items, tokens)
            for sliced in (False, True):
                name = sgmv_shapes.kernel_name(
                    sgmv_shapes.FUSED, torch.float16, max_rank, tokens, 90, split, warps, sliced, groups
                )[0]
                assert name in compiled
        assert sgmv_shapes.fused_shape(1, 16, max_rank, 80, 108, 16)[2] == 1  # no clusters before sm_90
    for split, groups, max_rank, tokens in ((4, 2, 128, 1), (16, 2, 32, 1), (8, 3, 64, 1), (16, 4, 128, 256)):
        with pytest.raises(ValueError, match="rank groups"):
            sgmv_shapes.kernel_name(sgmv_shapes.FUSED, torch.float16, max_rank, tokens, 90, split, 4, False, groups)


def _engine_op_report(job):
    src, name, arch = job
    return src, name, _ptxas_report(src, name, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_and_small_op_kernels_compile_without_spills(pool, arch):
    """The paged decode attention kernels (fp16/bf16 x head dims 64, 96, 128, 256; the group
    size 1..8 is an argument), the fused small ops and the sampling kernel, every instantiation the wrappers launch,
    for sm_80 and sm_90: no spills, and the decode kernel's shared memory within the arch's
    per-block limit."""
    from ops import paged_decode, sampling, small_ops

    jobs = [("attention.cu", n, arch) for n in paged_decode.all_kernel_names(arch)]
    jobs += [("small_ops.cu", n, arch) for n in small_ops.all_kernel_names()]
    jobs += [("sampling.cu", sampling.KERNEL, arch)]
    reports = list(pool.map(_engine_op_report, jobs))  # both workers at once
    assert (
        len(reports) == len(paged_decode.all_kernel_names(arch)) + len(small_ops.all_kernel_names()) + 1 == 8 + 12 + 1
    )
    assert {d for d in paged_decode.HEAD_DIMS} == {64, 96, 128, 256}  # Phi-3's 96 and Gemma's 256 among them
    assert any("gelu_tanh_mul_kernel" in name for _, name, _ in reports)  # Gemma's GeGLU
    for src, name, log in reports:
        assert re.search(r"Used \d+ registers", log), f"sm_{arch} {src} {name}:\n{log}"
        spills = re.search(r"(\d+) bytes spill stores", log)
        assert spills and spills.group(1) == "0", f"sm_{arch} {src} {name} spills:\n{log}"
    limit = {80: 163 << 10, 90: 227 << 10}[arch]  # opt-in dynamic shared memory per block
    for d in paged_decode.HEAD_DIMS:
        assert paged_decode.smem_bytes(d, paged_decode.WARPS, paged_decode.stages(d, arch)) <= limit


def test_every_group_size_and_head_dim_is_served_by_a_compiled_kernel():
    """supported() accepts exactly what a compiled kernel serves: groups 1..8 (Qwen2.5's 7,
    Llama 3.2 3B's 3), head dims 64/96/128/256, block sizes in whole 16-token tiles."""
    from ops import paged_decode

    for arch in ARCHS:
        names = set(paged_decode.all_kernel_names(arch))
        for dtype in (torch.float16, torch.bfloat16):
            for d in (64, 80, 96, 128, 256):
                for group in range(1, 10):
                    ok = paged_decode.supported(dtype, d, 4 * group, 4)
                    assert ok == (d != 80 and group <= 8), (d, group)
                    if ok:
                        assert paged_decode.kernel_name(dtype, d, arch) in names
    assert not paged_decode.supported(torch.float16, 128, 8, 2, block_size=8)
    assert paged_decode.supported(torch.float16, 128, 8, 2, block_size=32)
    assert not paged_decode.supported(torch.float32, 128, 8, 2)
