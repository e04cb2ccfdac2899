"""Fused projections: the LoRA add-ons of q|k|v (or gate|up) in one sliced launch, against one
launch per member (what the model ran before add_lora_sliced).

On the device:  python -m benchmarks.sgmv_sliced [--vllm] [--ranks 128] --out benchmarks/results/sgmv_sliced_h200.json
Anywhere:       python -m benchmarks.sgmv_sliced --plot-only
--vllm: vLLM's Triton kernels over the same members in the same run (one shrink and one expand
over all slices, as vLLM runs a fused projection; see benchmarks/sgmv.py), column vllm_us.

Method as benchmarks/sgmv.py: pools of 512 slots (one per member, allocated at the rank),
h_in 4096, fp16; each variant captured as one CUDA graph (the per-member graph holds its
launches back to back) and replayed behind a 256 MiB L2 flush; median of CUDA-event
timings. The floor: x once, each member's y columns read and written, each distinct
adapter's A and B of every member once, over the copy bandwidth measured in the same run.
"""

import argparse
import datetime
import json
import pathlib

import numpy as np
import torch

from benchmarks import vllm_peer
from benchmarks.method import REPS, copy_bandwidth, latency_axes, save_figure, time_graph
from benchmarks.sgmv import POOL, random_pool, request_adapters
from ops import sgmv, sgmv_plan, sgmv_shapes
from ops.lora import LoraSlice

H_IN = 4096
# members' output widths: Llama-2-7B q|k|v and gate|up, Llama-3-8B q|k|v (GQA)
PROJECTIONS = {"qkv 7B": (4096, 4096, 4096), "qkv 8B GQA": (4096, 1024, 1024), "gate_up 7B": (11008, 11008)}
RANKS = (16, 32, 64)
WORKLOADS = ("distinct", "uniform", "identical")
BATCHES = (1, 4, 16, 64, 256)
# the sliced launch with each cluster width: do the defaults (ops/sgmv.py's _FUSED_SHAPES, picked
# by the whole grid's items) hold for slices too?
SWEEP = [(p, r, "distinct", b) for p in ("qkv 7B", "gate_up 7B") for r in (16, 64) for b in (4, 16, 64)]
RESULT = pathlib.Path(__file__).parent / "results" / "sgmv_sliced_h200.json"


class Case:
    """One batch over one projection's members: every member adapted, adapters on random slots."""

    def __init__(self, pools, rank, workload, batch, rng):
        ids, counts = np.unique(request_adapters(workload, batch, rng), return_counts=True)
        slots = torch.tensor(rng.choice(POOL, len(ids), replace=False), dtype=torch.int32, device="cuda")
        self.row_slots = torch.repeat_interleave(slots, torch.tensor(counts, device="cuda"))
        self.indptr = torch.tensor(np.cumsum([0, *counts]), dtype=torch.int32, device="cuda")
        self.ranks = torch.full((POOL,), rank, dtype=torch.int32, device="cuda")
        self.scales = torch.rand(POOL, device="cuda") + 0.5
        widths = [B.shape[2] for _, B in pools]
        offsets = np.cumsum([0, *widths[:-1]])
        self.slices = [LoraSlice(A, B, slots, int(off)) for (A, B), off in zip(pools, offsets)]
        self.x = torch.randn(batch, H_IN, device="cuda", dtype=torch.float16)
        self.y = torch.randn(batch, sum(widths), device="cuda", dtype=torch.float16)
        self.floor_bytes = 2 * (
            self.x.numel() + 2 * self.y.numel() + len(ids) * rank * (len(widths) * H_IN + sum(widths))
        )

    def per_member(self):
        for s in self.slices:
            sgmv.add_lora(self.y, self.x, s.A, s.B, self.indptr, s.slot_ids, self.ranks, self.scales, s.y_offset)

    def sliced(self, split=None):
        sgmv.add_lora_sliced(self.y, self.x, self.slices, self.indptr, self.ranks, self.scales, split=split)

    def split(self):
        """The cluster width add_lora_sliced picks for this batch."""
        s = self.slices
        return sgmv_plan.launch_plan(
            sgmv_shapes.FUSED,
            self.x.shape[0],
            x=self.x,
            y=self.y,
            A=s[0].A,
            B=s[0].B,
            indptr=self.indptr,
            slot_ids=s[0].slot_ids,
            ranks=self.ranks,
            scales=self.scales,
            more=tuple(s[1:]),
        ).cluster

    def check(self):
        """The sliced launch adds what the per-member launches add (each checked against the
        fp32 reference by tests/gpu); y is left as it was."""
        y0 = self.y.clone()
        self.per_member()
        want = self.y.float() - y0.float()
        self.y.copy_(y0)
        self.sliced()
        got = self.y.float() - y0.float()
        self.y.copy_(y0)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-2, f"sliced differs from per-member launches: rel err {err:.1e}"


def run(out, with_vllm, ranks=RANKS):
    vllm_ops, vllm_version = vllm_peer.load() if with_vllm else (None, None)
    rng = np.random.default_rng(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth()
    rows, sweep = [], []
    for proj, widths in PROJECTIONS.items():
        for rank in ranks:
            pools = [random_pool(rank, H_IN, w) for w in widths]
            vllm_pool = vllm_peer.VllmPool(vllm_ops, pools) if with_vllm else None
            for workload in WORKLOADS:
                for batch in BATCHES:
                    case = Case(pools, rank, workload, batch, rng)
                    case.check()
                    vllm_add_on, vllm_err = (
                        vllm_pool.checked_add_on(case.x, case.y, case.row_slots) if vllm_pool else (None, None)
                    )
                    row = dict(
                        projection=proj,
                        rank=rank,
                        workload=workload,
                        batch=batch,
                        sliced_us=time_graph(case.sliced, flush),
                        per_member_us=time_graph(case.per_member, flush),
                        floor_us=case.floor_bytes / bw * 1e6,
                    )
                    if vllm_add_on:
                        row.update(vllm_us=time_graph(vllm_add_on, flush), vllm_rel_err=vllm_err)
                    rows.append(row)
                    print(
                        " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                        flush=True,
                    )
            for _, _, workload, batch in (c for c in SWEEP if c[:2] == (proj, rank)):
                case = Case(pools, rank, workload, batch, rng)
                sweep.append(
                    dict(
                        projection=proj,
                        rank=rank,
                        workload=workload,
                        batch=batch,
                        default_split=case.split(),
                        **{f"split{s}_us": time_graph(lambda: case.sliced(s), flush) for s in (4, 8, 16)},
                    )
                )
                print(sweep[-1], flush=True)
            del pools, vllm_pool
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        vllm=vllm_version,
        copy_bw_GBps=bw / 1e9,
        h_in=H_IN,
        pool=POOL,
        dtype="float16",
        reps=REPS,
        projections=PROJECTIONS,
        timing="median of CUDA-event timings of one CUDA graph (one sliced launch, or one launch per "
        "member back to back) replayed behind a 256 MiB L2 flush",
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows, sweep=sweep), indent=1))


def table(result):
    print(
        f"{'projection':>11} {'rank':>4} {'workload':>9} {'B':>4} {'sliced':>8} {'per-member':>11} {'vllm':>7}"
        f" {'floor':>7} {'sliced/per-member':>18} {'sliced/vllm':>12}"
    )
    for r in result["rows"]:
        vllm = r.get("vllm_us", float("nan"))
        print(
            f"{r['projection']:>11} {r['rank']:>4} {r['workload']:>9} {r['batch']:>4} {r['sliced_us']:8.1f} "
            f"{r['per_member_us']:11.1f} {vllm:7.1f} {r['floor_us']:7.1f} {r['sliced_us'] / r['per_member_us']:18.2f}"
            f" {r['sliced_us'] / vllm:12.2f}"
        )
    for r in result.get("sweep", []):
        widths = ", ".join(f"{s}: {r[f'split{s}_us']:.1f}" for s in (4, 8, 16))
        print(
            f"sweep {r['projection']} r={r['rank']} {r['workload']} B={r['batch']}: clusters of {widths} µs "
            f"(default {r['default_split']})"
        )


def plot(result, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    projections, ranks = list(result["meta"]["projections"]), sorted({r["rank"] for r in result["rows"]})
    fig, axes = plt.subplots(len(projections), len(WORKLOADS), figsize=(14, 11), sharex=True)
    for i, proj in enumerate(projections):
        for j, workload in enumerate(WORKLOADS):
            ax = axes[i][j]
            for k, rank in enumerate(ranks):
                rows = [
                    r for r in result["rows"] if (r["projection"], r["rank"], r["workload"]) == (proj, rank, workload)
                ]
                b = [r["batch"] for r in rows]
                ax.plot(b, [r["sliced_us"] for r in rows], marker="o", color=f"C{k}", label=f"r={rank} sliced")
                ax.plot(
                    b,
                    [r["per_member_us"] for r in rows],
                    marker="x",
                    linestyle="--",
                    color=f"C{k}",
                    label=f"r={rank} one launch per member",
                )
                if all("vllm_us" in r for r in rows):
                    ax.plot(
                        b,
                        [r["vllm_us"] for r in rows],
                        marker="s",
                        linestyle="-.",
                        color=f"C{k}",
                        label=f"r={rank} vLLM {result['meta']['vllm']} Triton, this run",
                    )
                ax.plot(b, [r["floor_us"] for r in rows], linestyle=":", color=f"C{k}", label=f"r={rank} floor")
            latency_axes(
                ax,
                f"{proj}, {workload}",
                BATCHES,
                "µs per projection's LoRA add-ons" if j == 0 else None,
                i == len(projections) - 1,
            )
    axes[0][0].legend(fontsize=7)
    meta = result["meta"]
    save_figure(
        fig,
        f"Sliced LoRA add-on of a fused projection, {meta['gpu']}, h_in={meta['h_in']}, fp16, "
        f"pool {meta['pool']} (copy bw {meta['copy_bw_GBps']:.0f} GB/s)",
        png,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=RESULT)
    ap.add_argument("--plot-only", action="store_true", help="read --out and write the PNG beside it")
    ap.add_argument("--vllm", action="store_true", help="time vLLM's Triton kernels too ($VLLM_PEER_SITE)")
    ap.add_argument("--ranks", type=lambda t: tuple(map(int, t.split(","))), default=RANKS)
    args = ap.parse_args()
    if not args.plot_only:
        run(args.out, args.vllm, args.ranks)
    result = json.loads(args.out.read_text())
    table(result)
    if args.plot_only:
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
