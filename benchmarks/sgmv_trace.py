"""Where a fused SGMV add-on spends its time, phase by phase (device only).

    python -m benchmarks.sgmv_trace [--out benchmarks/results/sgmv_trace_h200.json] [--define NAME ...]
        [--config RANK,BATCH ...] [--smem BYTES]

Runs add_lora's kernel built with -DSGMV_TRACE (kernels/sgmv.cu): warp 0 of every
block stamps the SM clock at each phase boundary, and the global timer at entry
and exit. Each configuration is launched REPS times behind the benchmark's L2
flush; per phase the table gives the median over launches of the median and the
slowest block's µs since that block's entry, plus how late the last block starts
after the first, the kernel's span (first entry to last exit), how many SMs ran a
block and the most blocks one SM ran, and how many of the kernel's clusters the
device holds at once. graph_us is the uninstrumented kernel timed as
benchmarks/sgmv.py times it; --define builds both with -DNAME (to compare variants
of the kernel in one run); --smem gives every block that much dynamic shared
memory, which caps how many blocks share an SM.
"""

import argparse
import json
import math
import pathlib

import numpy as np
import torch
from cuda.bindings import driver

from benchmarks.method import time_graph
from benchmarks.sgmv import Case, random_pool
from ops import launch, nvrtc

CONFIGS = [(16, 1), (16, 16), (16, 32), (16, 64), (32, 16), (32, 32), (64, 16), (64, 32)]  # (rank, batch), Distinct
PHASES = (
    "item found",
    "rank known",
    "shrink partial",
    "cluster sync",
    "v reduced",
    "expand start",
    "expand done",
    "cluster exit",
)
REPS = 30
RESULT = pathlib.Path(__file__).parent / "results" / "sgmv_trace_h200.json"


def _drv(result):
    err, *rest = result
    assert err == driver.CUresult.CUDA_SUCCESS, driver.cuGetErrorString(err)[1]
    return rest[0] if len(rest) == 1 else rest


def trace_once(case, func, buf, nbytes, flush, smem):
    """Per block: [entry ns, cycles at each phase (0: not reached), exit ns, SM] of one launch."""
    p = case.plan()
    assert p.blocks <= 4096, "sgmv_trace holds 4096 blocks"
    _drv(driver.cuMemsetD8(buf, 0, nbytes))
    flush.zero_()
    launch.launch(func, p.blocks, p.threads, p.args, p.device, smem)
    torch.cuda.synchronize()
    host = np.zeros((4096, 11), dtype=np.int64)
    _drv(driver.cuMemcpyDtoH(host.ctypes.data, buf, nbytes))
    return host[: p.blocks]


def with_smem(func, smem):
    """`func`, allowed `smem` bytes of dynamic shared memory (past the default 48 KiB)."""
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _drv(driver.cuFuncSetAttribute(func, attr, smem))
    return func


def with_policy(func, policy):
    """`func`, launched with cluster scheduling policy `policy` (CUclusterSchedulingPolicy; 0 the default)."""
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
    _drv(driver.cuFuncSetAttribute(func, attr, policy))
    return func


def summarize(traces, mhz):
    """Medians over launches of: start skew, span, and each phase's median / slowest block (µs);
    and over all launches' blocks, the shrink's median µs (rank known to partial) by how many
    blocks ran on the block's SM."""
    out = dict(
        start_skew_us=[],
        span_us=[],
        sms_used=[],
        most_blocks_per_sm=[],
        **{p: [] for p in PHASES},
        **{p + " (slowest)": [] for p in PHASES},
    )
    shrink_by_sm_load = {}
    for t in traces:
        per_sm = np.bincount(t[:, 10])
        out["sms_used"].append(int((per_sm > 0).sum()))
        out["most_blocks_per_sm"].append(int(per_sm.max()))
        live = t[t[:, 9] > 0]  # blocks that did the whole add-on
        load = per_sm[live[:, 10]]
        for k in np.unique(load):
            shrink_by_sm_load.setdefault(int(k), []).extend((live[load == k, 3] - live[load == k, 2]) / mhz)
        out["start_skew_us"].append((t[:, 0].max() - t[:, 0].min()) / 1e3)
        out["span_us"].append((t[:, 9].max() - t[:, 0].min()) / 1e3)
        for i, p in enumerate(PHASES, start=1):
            reached = live[:, i][live[:, i] > 0] / mhz
            out[p].append(float(np.median(reached)) if reached.size else math.nan)
            out[p + " (slowest)"].append(float(reached.max()) if reached.size else math.nan)
    return {
        **{k: float(np.median(v)) for k, v in out.items()},
        "shrink_us_by_blocks_on_sm": {k: float(np.median(v)) for k, v in sorted(shrink_by_sm_load.items())},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=RESULT)
    ap.add_argument("--define", action="append", default=[], help="build the kernel with -DNAME")
    ap.add_argument(
        "--config",
        action="append",
        type=lambda t: tuple(map(int, t.split(","))),
        help="RANK,BATCH (Distinct) to trace instead of the default list (repeatable)",
    )
    ap.add_argument(
        "--smem",
        type=int,
        default=0,
        help="dynamic shared memory per block, bytes (to cap how many blocks share an SM)",
    )
    args = ap.parse_args()
    defines = tuple(f"-D{d}" for d in args.define)
    rng = np.random.default_rng(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    mhz = torch.cuda.clock_rate()  # current SM clock, MHz (cycles per µs)
    rows = []
    for rank, batch in args.config or CONFIGS:
        pool = random_pool(rank)
        case = Case(rank, "distinct", batch, rng, pool)
        p = case.plan()
        plain = with_smem(nvrtc.load_function("sgmv.cu", p.name, p.device.index, defines), args.smem)
        graph_us = time_graph(lambda: launch.launch(plain, p.blocks, p.threads, p.args, p.device, args.smem), flush)
        func = with_smem(nvrtc.load_function("sgmv.cu", p.name, p.device.index, (*defines, "-DSGMV_TRACE")), args.smem)
        buf, nbytes = _drv(driver.cuModuleGetGlobal(_drv(driver.cuFuncGetModule(func)), b"sgmv_trace"))
        traces = [trace_once(case, func, buf, nbytes, flush, args.smem) for _ in range(REPS + 3)][3:]
        clusters = launch.max_active_clusters(plain, p.cluster, p.threads, args.smem)
        rows.append(
            dict(
                rank=rank,
                batch=batch,
                kernel=p.name,
                defines=args.define,
                smem=args.smem,
                blocks=p.blocks,
                max_active_clusters=clusters,
                sm_mhz=mhz,
                graph_us=graph_us,
                **summarize(traces, mhz),
            )
        )
        del pool
    args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    print("defines:", args.define)
    cols = ("graph_us", "start_skew_us", "span_us", "sms_used", "most_blocks_per_sm", *PHASES)
    print(f"{'r':>3} {'B':>3} {'blocks':>6} " + " ".join(f"{c[:12]:>12}" for c in cols))
    for r in rows:
        print(f"{r['rank']:>3} {r['batch']:>3} {r['blocks']:>6} " + " ".join(f"{r[c]:12.2f}" for c in cols))
        print(" " * 14 + "slowest " + " " * 57 + " ".join(f"{r[p + ' (slowest)']:12.2f}" for p in PHASES))
        print(" " * 14 + "shrink µs by blocks on the SM: " + str(r["shrink_us_by_blocks_on_sm"]))


if __name__ == "__main__":
    main()
