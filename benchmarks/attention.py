"""Paged decode attention alone: one query per sequence over its paged KV, 32 sequences,
contexts 256..4096, fp16, head dim 128; Llama-2-7B heads (32 / 32 KV) and a GQA shape
(32 / 8 KV, Llama-3-8B).

On the device:  python benchmarks/attention.py [--vllm]   (--vllm after `source .vllm-peer/install.sh`)
Anywhere:       python benchmarks/attention.py --plot-only

Ours is also timed at every split count in SPLITS, beside the one decode_splits picks.
Each kernel is captured as a one-call CUDA graph and replayed behind an L2 flush, median of
CUDA-event timings (benchmarks/method.py). Floor: K and V of every context, q and out, once,
over the copy bandwidth measured here. Peers in the same run: the gather + masked SDPA path
this kernel replaced (ops/attention.py's AttentionGroup), and with --vllm vLLM's Triton
unified_attention (its 2D kernel: what vLLM's Triton backend runs from 128 / kv_heads
sequences up, so for these batches), checked against ours first.
"""
import argparse
import datetime
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.method import copy_bandwidth, save_figure, time_graph  # noqa: E402
from ops import attention as gather_path  # noqa: E402
from ops import paged_attention as pa  # noqa: E402

SEQS, D, BS = 32, 128, 16
CONTEXTS = (256, 512, 1024, 2048, 4096)
SHAPES = {"mha_32_32": (32, 32), "gqa_32_8": (32, 8)}
SPLITS = (1, 2, 4, 8)  # grid.z values timed beside decode_splits' choice


def _case(heads, kv_heads, ctx, gen):
    blocks = SEQS * ctx // BS
    k = torch.randn(blocks, BS, kv_heads, D, device="cuda", generator=gen).half()
    v = torch.randn(blocks, BS, kv_heads, D, device="cuda", generator=gen).half()
    tables = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(SEQS, ctx // BS)
    lens = torch.full((SEQS,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(SEQS, heads, D, device="cuda", generator=gen).half()
    return q, k, v, tables, lens


def _gather_group(tables, ctx):
    idx = torch.arange(ctx, device="cuda")
    kv_index = tables[:, idx // BS].long() * BS + idx % BS  # [seqs, ctx]
    return gather_path.AttentionGroup(torch.arange(SEQS, device="cuda")[:, None], kv_index,
                                      torch.zeros(SEQS, 1, 1, ctx, device="cuda"), torch.arange(SEQS, device="cuda"),
                                      torch.arange(SEQS, device="cuda"))


def measure(vllm_ops, bw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(2**28 // 4, dtype=torch.float32, device="cuda")
    rows = []
    for shape, (heads, kv_heads) in SHAPES.items():
        for ctx in CONTEXTS:
            q, k, v, tables, lens = _case(heads, kv_heads, ctx, gen)
            out = torch.empty_like(q)
            splits = pa.decode_splits(SEQS, kv_heads, "cuda")
            ours = lambda: pa.paged_decode(out, q, k, v, tables, lens, D**-0.5, splits)  # noqa: E731
            floor = (2 * k.numel() * 2 + 2 * q.numel() * 2) / bw * 1e6
            row = dict(shape=shape, context=ctx, seqs=SEQS, splits=splits, floor_us=floor, ours_us=time_graph(ours, flush))
            row["ours_us_by_splits"] = {n: time_graph(lambda n=n: pa.paged_decode(out, q, k, v, tables, lens, D**-0.5, n),
                                                      flush) for n in SPLITS}
            group = _gather_group(tables, ctx)
            ref = torch.empty_like(q)
            gather_path.paged_attention(ref, q, k, v, (group,), D**-0.5)
            ours()
            row["ours_vs_gather_rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
            row["gather_sdpa_us"] = time_graph(lambda: gather_path.paged_attention(ref, q, k, v, (group,), D**-0.5), flush)
            if vllm_ops is not None:
                vout = torch.empty_like(q)
                cu = torch.arange(SEQS + 1, dtype=torch.int32, device="cuda")

                def peer():
                    vllm_ops.unified_attention(q, k, v, vout, cu, 1, lens, ctx, D**-0.5, True, (-1, -1), tables,
                                               0.0, None, None, None)
                peer()
                row["vllm_rel_err_vs_ours"] = float((vout.float() - out.float()).norm() / out.float().norm())
                row["vllm_us"] = time_graph(peer, flush)
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(12, 4), squeeze=False)
    for ax, shape in zip(axes[0], SHAPES):
        rows = [r for r in data["rows"] if r["shape"] == shape]
        ctx = [r["context"] for r in rows]
        for key, label in (("ours_us", "loraplex paged_decode"), ("vllm_us", "vLLM unified_attention (Triton)"),
                           ("gather_sdpa_us", "gather + SDPA (before)"), ("floor_us", "bytes / bandwidth")):
            if all(key in r for r in rows):
                ax.plot(ctx, [r[key] for r in rows], marker="o", label=label, ls="--" if key == "floor_us" else "-")
        ax.set(xscale="log", yscale="log", title=f"{shape}, {SEQS} sequences", xlabel="context", ylabel="µs")
        ax.set_xticks(ctx)
        ax.set_xticklabels(ctx)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, f"decode attention, fp16, head dim {D}, {data['device']}", png)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "attention_h200.json")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    vllm_ops, version = None, None
    if args.vllm:
        from benchmarks import vllm_peer

        _, version = vllm_peer.load()
        from vllm.v1.attention.ops import triton_unified_attention as vllm_ops
    bw = copy_bandwidth()
    rows = measure(vllm_ops, bw)
    data = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), vllm=version,
                copy_bandwidth_Bps=bw, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    plot(data, args.out.with_suffix(".png"))
    print(f"\n{'shape':10s} {'ctx':>5s} {'ours µs':>8s} {'floor':>7s} {'x floor':>7s} {'vLLM':>7s} {'gather':>7s}")
    for r in rows:
        print(f"{r['shape']:10s} {r['context']:5d} {r['ours_us']:8.1f} {r['floor_us']:7.1f} {r['ours_us'] / r['floor_us']:7.2f} "
              f"{r.get('vllm_us', float('nan')):7.1f} {r['gather_sdpa_us']:7.1f}")


if __name__ == "__main__":
    main()
