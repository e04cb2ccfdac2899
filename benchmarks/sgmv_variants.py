"""A/B comparison of add_lora kernel builds on the device, timed interleaved.

    python benchmarks/sgmv_variants.py --variant base= --variant new=SOME_MACRO \
        [--variant c8=:split=8] [--config 64,identical,512[,H_IN] ...] [--read-flush] [--no-check] \
        [--out /tmp/NAME.json]

A variant is NAME=DEFINE[,DEFINE...][:option=value...][@KERNEL_DIR]: the kernel built with
those -D macros (from KERNEL_DIR's sources, e.g. an older commit's ops/kernels, instead of
the tree's), and add_lora's forced options (split=N, warps=N, groups=N; extra_items=1 for an older
build whose item list still holds row block 0, which needs one cluster more; smem=BYTES of
dynamic shared memory per block, to cap how many blocks share an SM; policy=N the
cluster scheduling policy, 1 spread, 2 load balancing: give such a variant a -D of its own,
as variants with the same -D share one compiled function; arch=80 the kernels and grid
shapes an older arch gets, built as its PTX). Each
configuration's variants are timed as benchmarks/sgmv.py times them (graph replay
behind the 256 MiB L2 flush, median of 100), in ROUNDS interleaved rounds so the
machine's drift hits all alike; after each variant's first run its output is
checked against the Loop baseline (--no-check: for speed probes that compute
wrong sums on purpose). --read-flush flushes L2 with a 256 MiB read instead of
the write, so L2 holds clean lines: the difference is what write-backs cost.
"""
import argparse
import contextlib
import functools
import json
import pathlib
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.method import time_graph  # noqa: E402
from benchmarks.sgmv import H, Case, random_pool, rel_err  # noqa: E402
from benchmarks.sgmv_trace import with_policy, with_smem  # noqa: E402
from ops import launch, nvrtc, sgmv  # noqa: E402

CONFIGS = [(r, w, b, H) for r, w, b in [(16, "distinct", b) for b in (1, 16, 32, 64)] + [
    (32, "distinct", b) for b in (16, 32, 64)] + [(64, "distinct", b) for b in (1, 16, 32)] + [
    (8, "distinct", 64), (16, "identical", 64), (64, "identical", 64), (64, "uniform", 64), (16, "uniform", 2048)]]
ROUNDS = 3


def parse_config(text):
    rank, workload, batch, *h_in = text.split(",")
    return int(rank), workload, int(batch), int(h_in[0]) if h_in else H


def parse_variant(text):
    name, _, spec = text.partition("=")
    spec, _, kernel_dir = spec.partition("@")
    defines, _, opts = spec.partition(":")
    force = {k: int(v) for k, v in (kv.split("=") for kv in opts.split(",") if kv)}
    defines = tuple(f"-D{d}" for d in defines.split(",") if d)
    if kernel_dir:  # the define keeps its compiled kernels apart in nvrtc's caches
        defines += (f"-DSGMV_KERNEL_DIR_{zlib.crc32(kernel_dir.encode())}",)
    return name, defines, force, kernel_dir


@contextlib.contextmanager
def kernel_sources(kernel_dir):
    """nvrtc compiles from `kernel_dir` (e.g. a commit's ops/kernels, `git archive`d) meanwhile."""
    if not kernel_dir:
        yield
        return
    saved = nvrtc.KERNEL_DIR
    nvrtc.KERNEL_DIR = pathlib.Path(kernel_dir).resolve()
    nvrtc._sources_digest.cache_clear()
    try:
        yield
    finally:
        nvrtc.KERNEL_DIR = saved
        nvrtc._sources_digest.cache_clear()


@contextlib.contextmanager
def planned_for(arch):
    """add_lora plans for `arch` meanwhile (0: the device's own)."""
    saved = sgmv._arch
    if arch:
        sgmv._arch = lambda index: arch
    try:
        yield
    finally:
        sgmv._arch = saved


def runner(case, defines, force, kernel_dir):
    force = dict(force)
    extra_items, smem, policy, arch = (force.pop(k, 0) for k in ("extra_items", "smem", "policy", "arch"))
    with planned_for(arch):
        p = case.plan(**force)
    blocks = p.blocks + extra_items * p.cluster
    with kernel_sources(kernel_dir):
        func = nvrtc.load_function("sgmv.cu", p.name, p.device.index, defines, arch=arch or None)
        func = with_policy(with_smem(func, smem), policy)
    return lambda: launch.launch(func, blocks, p.threads, p.args, p.device, smem)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, type=parse_variant)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--config", action="append", type=parse_config,
                    help="RANK,WORKLOAD,BATCH to time instead of the default list (repeatable)")
    ap.add_argument("--no-check", action="store_true", help="time speed probes whose sums are wrong")
    ap.add_argument("--read-flush", action="store_true",
                    help="flush L2 by reading 256 MiB instead (clean lines): what the write-backs cost")
    ap.add_argument("--no-flush", action="store_true", help="leave L2 hot: what the DRAM round trips cost")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    flush = torch.ones(128 * 2**20, dtype=torch.float16, device="cuda")
    if args.read_flush:
        flush = functools.partial(torch.sum, flush, dtype=torch.float32)
    if args.no_flush:  # the GPU still waits in a spin kernel, so the host's launch is not timed
        flush = functools.partial(torch.cuda._sleep, 100_000)
    rows = []
    for rank, workload, batch, h_in in args.config or CONFIGS:
        pool = random_pool(rank, h_in)
        case = Case(rank, workload, batch, rng, pool)
        fns = {name: runner(case, d, f, k) for name, d, f, k in args.variant}
        errs = {name: rel_err(case, fn) for name, fn in fns.items()}
        assert args.no_check or max(errs.values()) < 2e-2, errs
        times = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                times[name].append(time_graph(fn, flush))
        rows.append(dict(rank=rank, workload=workload, batch=batch, h_in=h_in, rel_err=errs,
                         us={n: float(np.median(t)) for n, t in times.items()}, rounds=times))
        del pool, case
    names = [n for n, *_ in args.variant]
    print("variants:", {n: (d, f, k) for n, d, f, k in args.variant})
    print(f"{'r':>3} {'workload':>9} {'B':>5} {'h_in':>6} " + " ".join(f"{n:>10}" for n in names))
    for r in rows:
        print(f"{r['rank']:>3} {r['workload']:>9} {r['batch']:>5} {r['h_in']:>6} "
              + " ".join(f"{r['us'][n]:10.2f}" for n in names))
    if args.out:
        args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), variants=args.variant, rows=rows),
                                       indent=1, default=str))


if __name__ == "__main__":
    main()
