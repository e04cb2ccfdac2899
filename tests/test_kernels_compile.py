"""CI (no GPU): every SGMV kernel the wrappers can launch compiles with NVRTC for sm_80 and sm_90."""
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from ops import nvrtc, sgmv

ARCHS = (80, 90)


def _report(job):
    name, arch = job
    return name, arch, nvrtc.resource_report("sgmv.cu", name, arch)


@pytest.fixture(scope="module")
def reports():
    jobs = [(name, arch) for arch in ARCHS for name in sgmv.all_kernel_names(arch)]
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(_report, jobs))


def test_every_kernel_compiles_without_spills(reports):
    assert len(reports) == sum(len(sgmv.all_kernel_names(a)) for a in ARCHS) >= 2 * 32
    for name, arch, log in reports:
        spills = re.search(r"(\d+) bytes spill stores", log)
        assert spills and spills.group(1) == "0", f"sm_{arch} {name} spills:\n{log}"


def test_split_k_clusters_only_on_sm90():
    for arch in ARCHS:
        name, split, _ = sgmv.kernel_name(sgmv.FUSED, torch.float16, 16, 64, arch)
        assert ("cluster" in name) == (arch >= 90) and split == (8 if arch >= 90 else 1)


def test_compile_errors_carry_the_log():
    with pytest.raises(nvrtc.CompileError, match="sgmv_kernel<int"):
        nvrtc.compile_kernel("sgmv.cu", "sgmv_kernel<int, 16, 1, 1, 0, float>", 90)


def test_cubins_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    name = sgmv.kernel_name(sgmv.FUSED, torch.bfloat16, 32, 4096, 90)[0]
    compile_uncached = nvrtc.compile_kernel.__wrapped__
    cubin, symbol = compile_uncached("sgmv.cu", name, 90)
    assert cubin[:4] == b"\x7fELF" and symbol.startswith("_Z")
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert compile_uncached("sgmv.cu", name, 90) == (cubin, symbol)
