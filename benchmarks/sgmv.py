"""Punica Fig. 8/9 on one GPU: latency of one LoRA add-on (y += x A B) against batch size.

On the device:  python -m benchmarks.sgmv --out benchmarks/results/sgmv_h200.json
Anywhere:       python -m benchmarks.sgmv --plot-only [--peers ../shared/anchors/sgmv_peers_h200.json]
The A100's kernels on this GPU: --arch 80 --out benchmarks/results/sgmv_h200_sm80.json
vLLM's Triton kernels in the same run: --vllm (after `source .vllm-peer/install.sh` on the
device; benchmarks/make-vllm-bundle.sh builds it here), column vllm_us.
Other shapes and ranks (the grid's rows only): --h-in 11008 --ranks 8,16,32,64,128 (a down
projection), --ranks 128, each with its own --out.

Method (same as the peer figures): adapter pool of 512 slots, h=4096 (by default), fp16;
each variant is captured as a one-add-on CUDA graph and replayed behind an L2
flush (a 256 MiB write); the median of CUDA-event timings is reported. The
floor is the bytes that must move (x, each distinct adapter's A and B once, y
read and written) over the device-to-device copy bandwidth measured here;
read_only is the same number of bytes read by a kernel that does nothing else,
timed the same way (benchmarks/read_floor.py): what this method gives any kernel.
"""

import argparse
import datetime
import itertools
import json
import math
import pathlib

import numpy as np
import torch

from benchmarks import sgmv_halves, vllm_peer
from benchmarks.method import REPS, copy_bandwidth, latency_axes, save_figure, time_graph
from ops import sgmv, sgmv_plan, sgmv_shapes

RANKS = (8, 16, 32, 64)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
WORKLOADS = ("distinct", "uniform", "skewed", "identical")
PREFILL = [(r, w, t) for r in (16, 64) for w in ("identical", "uniform") for t in (512, 2048, 8192)]
# add_lora with each cluster width, with 4/8 warps per block: to pick the defaults
SWEEP = [(r, "distinct", b) for r in (16, 32, 64) for b in (1, 16, 32, 64)] + [
    (64, "identical", 1),
    (64, "identical", 64),
    (64, "uniform", 32),
    (8, "distinct", 64),
    (16, "identical", 2048),
    (64, "uniform", 2048),
    (16, "uniform", 8192),
]
# where the time goes: each phase alone, and a second add-on straight after (its data L2-hot)
PHASES = [(r, b) for r in (16, 32, 64) for b in (1, 16, 32, 64)]
H, POOL, ZIPF = 4096, 512, 1.5
RESULT = pathlib.Path(__file__).parent / "results" / "sgmv_h200.json"


def random_pool(rank, h_in=H, h_out=H):
    """A and B of POOL adapter slots ([slots, rank, h_in], [slots, rank, h_out]), scaled so v and
    the add-on are of the order of x."""
    return (
        torch.randn(POOL, rank, h_in, device="cuda", dtype=torch.float16) / math.sqrt(h_in),
        torch.randn(POOL, rank, h_out, device="cuda", dtype=torch.float16) / math.sqrt(rank),
    )


def floor_bytes(tokens, adapters, rank, h_in, h_out):
    """The bytes one fp16 add-on must move: x read, y read and written, each adapter's A and B once."""
    return 2 * (tokens * h_in + 2 * tokens * h_out + adapters * rank * (h_in + h_out))


def request_adapters(workload, batch, rng):
    """Adapter index of every request (one row each) under Punica's four popularity laws."""
    if workload == "distinct":
        return np.arange(batch)
    if workload == "uniform":
        return rng.integers(0, math.ceil(math.sqrt(batch)), batch)
    if workload == "skewed":
        p = 1.0 / np.arange(1, batch + 1) ** ZIPF
        return rng.choice(batch, batch, p=p / p.sum())
    return np.zeros(batch, dtype=np.int64)


class Case:
    """One batch: rows grouped by adapter into segments, adapters on random pool slots."""

    def __init__(self, rank, workload, batch, rng, pool):
        ids, counts = np.unique(request_adapters(workload, batch, rng), return_counts=True)
        self.slots = [int(s) for s in rng.choice(POOL, len(ids), replace=False)]
        self.bounds = np.cumsum([0, *counts]).tolist()
        self.rank, self.batch, self.A, self.B = rank, batch, pool[0], pool[1]
        self.ranks = torch.full((POOL,), rank, dtype=torch.int32, device="cuda")
        self.scales = torch.rand(POOL, device="cuda") + 0.5
        self.indptr = torch.tensor(self.bounds, dtype=torch.int32, device="cuda")
        self.slot_ids = torch.tensor(self.slots, dtype=torch.int32, device="cuda")
        self.row_slots = torch.repeat_interleave(self.slot_ids.long(), torch.tensor(counts, device="cuda"))
        self.x = torch.randn(batch, self.A.shape[2], device="cuda", dtype=torch.float16)
        self.y = torch.randn(batch, self.B.shape[2], device="cuda", dtype=torch.float16)
        self.v = torch.empty(batch, rank, device="cuda")

    def segs(self):
        return self.indptr, self.slot_ids, self.ranks

    def ours(self, split=None, warps=None):
        """split / warps None: the defaults; forced for the sweep."""
        sgmv.add_lora(self.y, self.x, self.A, self.B, *self.segs(), self.scales, split=split, warps=warps)

    def plan(self, **force):
        """add_lora's launch for this batch (split / warps forced or the defaults)."""
        return sgmv_plan.launch_plan(
            sgmv_shapes.FUSED,
            self.batch,
            x=self.x,
            y=self.y,
            A=self.A,
            B=self.B,
            indptr=self.indptr,
            slot_ids=self.slot_ids,
            ranks=self.ranks,
            scales=self.scales,
            **force,
        )

    def ours_2launch(self):
        sgmv_halves.sgmv_shrink(self.v, self.x, self.A, *self.segs())
        sgmv_halves.sgmv_expand(self.y, self.v, self.B, *self.segs(), self.scales)

    def loop(self):
        for slot, lo, hi in zip(self.slots, self.bounds[:-1], self.bounds[1:]):
            self.y[lo:hi] += (self.x[lo:hi] @ self.A[slot].T @ self.B[slot]) * self.scales[slot]

    def gather_bmm(self):
        v = torch.bmm(self.x[:, None, :], self.A[self.row_slots].transpose(1, 2))
        self.y += torch.bmm(v, self.B[self.row_slots])[:, 0] * self.scales[self.row_slots, None]

    def floor_bytes(self):
        return floor_bytes(self.x.shape[0], len(self.slots), self.rank, self.A.shape[2], self.B.shape[2])


def rel_err(case, fn):
    """Relative error of fn's add-on to y against the Loop baseline's; y is left as it was."""
    y0 = case.y.clone()
    fn()
    ours = case.y.float() - y0.float()
    case.y.copy_(y0)
    case.loop()
    ref = case.y.float() - y0.float()
    case.y.copy_(y0)
    return float((ours - ref).norm() / ref.norm())


def check(case):
    """ours must equal the Loop baseline before its time is worth reporting."""
    err = rel_err(case, case.ours)
    assert err < 2e-2, f"r={case.rank} B={case.batch}: rel err {err:.1e}"


def time_phases(case, flush):
    """µs of the fused add-on, of the shrink and the expand kernels alone, and of two fused
    add-ons back to back (the second finds x, A and B in L2: what latency alone costs)."""
    return dict(
        rank=case.rank,
        workload="distinct",
        batch=case.batch,
        fused_us=time_graph(case.ours, flush),
        shrink_us=time_graph(lambda: sgmv_halves.sgmv_shrink(case.v, case.x, case.A, *case.segs()), flush),
        expand_us=time_graph(lambda: sgmv_halves.sgmv_expand(case.y, case.v, case.B, *case.segs(), case.scales), flush),
        fused_twice_us=time_graph(lambda: (case.ours(), case.ours()), flush),
    )


def sweep_shapes():
    """(blocks per item, warps) to force: cluster widths with 4 or 8 warps on sm_90; before it,
    split-K through L2 over 1-16 blocks (4 warps; past what the GPU holds at once, 1: the
    sweep records the split launched)."""
    if sgmv_plan.kernel_arch(torch.cuda.current_device()) >= 90:
        return list(itertools.product((4, 8, 16), (4, 8)))
    return [(s, 4) for s in (1, 4, 8, 16)]


def run(out, with_vllm, ranks=RANKS, h_in=H, h_out=H):
    """The grid over `ranks` at h_in x h_out; prefill, phases and the sweep at the default shape only."""
    from benchmarks.read_floor import ReadFloor  # triton: on the device only

    vllm_ops, vllm_version = vllm_peer.load() if with_vllm else (None, None)

    rng = np.random.default_rng(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth()
    null_us = time_graph(lambda: torch.cuda._sleep(0), flush)
    reads = ReadFloor(floor_bytes(max(BATCHES), max(BATCHES), max(ranks), h_in, h_out), time_graph, flush)
    default_shape = (h_in, h_out) == (H, H)
    rows, prefill, sweep, phases = [], [], [], []
    for rank in ranks:
        pool = random_pool(rank, h_in, h_out)
        vllm_pool = vllm_peer.VllmPool(vllm_ops, [pool]) if with_vllm else None
        for workload in WORKLOADS:
            for batch in BATCHES:
                case = Case(rank, workload, batch, rng, pool)
                check(case)
                vllm_add_on, vllm_err = (
                    vllm_pool.checked_add_on(case.x, case.y, case.row_slots) if vllm_pool else (None, None)
                )
                row = dict(
                    rank=rank,
                    workload=workload,
                    batch=batch,
                    num_adapters=len(case.slots),
                    ours_us=time_graph(case.ours, flush),
                    ours_2launch_us=time_graph(case.ours_2launch, flush),
                    loop_us=time_graph(case.loop, flush),
                    gather_bmm_us=time_graph(case.gather_bmm, flush),
                    floor_us=case.floor_bytes() / bw * 1e6,
                    read_only_us=reads.read_us(case.floor_bytes()),
                )
                if vllm_add_on:
                    row.update(vllm_us=time_graph(vllm_add_on, flush), vllm_rel_err=vllm_err)
                rows.append(row)
                print(
                    " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
                )
        for r, workload, tokens in PREFILL:
            if r == rank and default_shape:
                case = Case(rank, workload, tokens, rng, pool)
                check(case)
                prefill.append(
                    dict(
                        rank=rank,
                        workload=workload,
                        tokens=tokens,
                        num_adapters=len(case.slots),
                        ours_us=time_graph(case.ours, flush),
                        loop_us=time_graph(case.loop, flush),
                        floor_us=case.floor_bytes() / bw * 1e6,
                    )
                )
                print(prefill[-1], flush=True)
        for r, batch in PHASES:
            if r == rank and default_shape:
                phases.append(time_phases(Case(rank, "distinct", batch, rng, pool), flush))
                print(phases[-1], flush=True)
        for r, workload, batch in SWEEP:
            if r == rank and default_shape:
                case = Case(rank, workload, batch, rng, pool)
                for split, warps in sweep_shapes():
                    sweep.append(
                        dict(
                            rank=rank,
                            workload=workload,
                            batch=batch,
                            split=case.plan(split=split).cluster,
                            warps=warps,
                            us=time_graph(lambda: case.ours(split, warps), flush),
                        )
                    )
                    print(sweep[-1], flush=True)
        del pool, vllm_pool
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        kernel_arch=sgmv_plan.kernel_arch(torch.cuda.current_device()),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        vllm=vllm_version,
        copy_bw_GBps=bw / 1e9,
        null_graph_us=null_us,
        h_in=h_in,
        h_out=h_out,
        pool=POOL,
        dtype="float16",
        zipf_alpha=ZIPF,
        reps=REPS,
        timing="median of CUDA-event timings of a one-add-on CUDA graph replayed behind a 256 MiB "
        "L2 flush; null_graph_us: the same for a graph holding one empty kernel",
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows, prefill=prefill, sweep=sweep, phases=phases), indent=1))


def attach_peers(result, peers_path):
    """Copy the issue's vLLM figure for each (rank, workload, batch) into the rows, as vllm_anchor_us."""
    peers = {(p["rank"], p["workload"], p["batch"]): p for p in json.loads(peers_path.read_text())["rows"]}
    for row in result["rows"]:
        peer = peers.get((row["rank"], row["workload"], row["batch"]))
        if peer:
            row["vllm_anchor_us"] = peer["vllm_triton_graph_us"]


def table(result):
    cols = (
        "ours_us",
        "vllm_us",
        "vllm_anchor_us",
        "ours_2launch_us",
        "gather_bmm_us",
        "loop_us",
        "read_only_us",
        "floor_us",
    )
    print(
        f"{'rank':>4} {'workload':>9} {'B':>3} " + " ".join(f"{c[:-3]:>14}" for c in cols) + "  ours/vllm  ours/anchor"
    )
    for r in result["rows"]:
        ratios = (r["ours_us"] / r[c] if r.get(c) else float("nan") for c in ("vllm_us", "vllm_anchor_us"))
        print(
            f"{r['rank']:>4} {r['workload']:>9} {r['batch']:>3} "
            + " ".join(f"{r.get(c, float('nan')):14.1f}" for c in cols)
            + "".join(f"  {x:9.2f}" for x in ratios)
        )
    for p in result.get("prefill", []):
        print(
            f"prefill r={p['rank']} {p['workload']} T={p['tokens']}: ours {p['ours_us']:.1f} µs, "
            f"loop {p['loop_us']:.1f} µs, floor {p['floor_us']:.1f} µs"
        )
    null = result["meta"]["null_graph_us"]
    for p in result.get("phases", []):
        print(
            f"phases r={p['rank']} distinct B={p['batch']}: fused {p['fused_us']:.1f} = graph floor {null:.1f} "
            f"+ kernel {p['fused_us'] - null:.1f} µs (L2-hot: {p['fused_twice_us'] - p['fused_us']:.1f}); "
            f"shrink alone {p['shrink_us']:.1f}, expand alone {p['expand_us']:.1f}"
        )


def plot(result, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["rank"] for r in result["rows"]})
    fig, axes = plt.subplots(len(ranks), len(WORKLOADS), figsize=(16, 3.5 * len(ranks)), sharex=True, squeeze=False)
    series = (
        ("ours_us", "ours (CUDA, NVRTC)"),
        ("vllm_us", f"vLLM {result['meta'].get('vllm')} Triton, this run"),
        ("vllm_anchor_us", "vLLM Triton, the issue's figures"),
        ("gather_bmm_us", "Gather-BMM"),
        ("loop_us", "Loop"),
        ("read_only_us", "read-only kernel, same bytes, same method"),
        ("floor_us", "floor (bytes / copy bw)"),
    )
    for i, rank in enumerate(ranks):
        for j, workload in enumerate(WORKLOADS):
            ax, rows = axes[i][j], [r for r in result["rows"] if r["rank"] == rank and r["workload"] == workload]
            for key, label in series:
                if all(key in r for r in rows):
                    ax.plot(
                        [r["batch"] for r in rows],
                        [r[key] for r in rows],
                        marker="o",
                        label=label,
                        linestyle="--" if key in ("floor_us", "read_only_us") else "-",
                    )
            ax.axhline(result["meta"]["null_graph_us"], color="grey", linestyle=":", label="graph of one empty kernel")
            latency_axes(
                ax, f"r={rank} {workload}", BATCHES, "µs per LoRA add-on" if j == 0 else None, i == len(ranks) - 1
            )
    axes[0][0].legend(fontsize=8)
    meta = result["meta"]
    older = f", kernels built for sm_{meta['kernel_arch']}" if meta.get("kernel_arch", 90) < 90 else ""
    shape = f"h={meta['hidden']}" if "hidden" in meta else f"h_in={meta['h_in']}, h_out={meta['h_out']}"
    save_figure(
        fig,
        f"SGMV LoRA add-on, {meta['gpu']}{older}, {shape}, fp16, pool {meta['pool']} "
        f"(copy bw {meta['copy_bw_GBps']:.0f} GB/s)",
        png,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=RESULT)
    ap.add_argument("--plot-only", action="store_true", help="read --out, add --peers, write the PNG")
    ap.add_argument("--peers", type=pathlib.Path, help="peer figures (vLLM) to compare against")
    ap.add_argument("--vllm", action="store_true", help="time vLLM's Triton kernels too ($VLLM_PEER_SITE)")
    ap.add_argument(
        "--arch",
        type=int,
        help="run the kernels built for this older arch (80: the A100's, no "
        "clusters; PTX compiled by the driver) on this GPU",
    )
    ap.add_argument("--ranks", type=lambda t: tuple(map(int, t.split(","))), default=RANKS)
    ap.add_argument("--h-in", type=int, default=H)
    ap.add_argument("--h-out", type=int, default=H)
    args = ap.parse_args()
    if args.arch:
        sgmv_plan.kernel_arch = lambda index: args.arch
    if not args.plot_only:
        run(args.out, args.vllm, args.ranks, args.h_in, args.h_out)
    result = json.loads(args.out.read_text())
    if args.peers:
        attach_peers(result, args.peers)
        args.out.write_text(json.dumps(result, indent=1))
    table(result)
    if args.plot_only:
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
