"""Sampled decoding against greedy, end to end (benchmarks/e2e_throughput.py --sampling).

On the device:  python -m benchmarks.e2e_throughput --sampling
Anywhere:       python -m benchmarks.e2e_throughput --sampling --plot-only

Same engine, model (Llama-2-7B shape, random fp16) and adapters as e2e_throughput.py; 128 requests
of 128 prompt / 128 new tokens queued at once; max batch 32 and 64; workloads backbone and distinct.
Per workload, in one run: greedy; temperature 0.8 + top_p 0.95 seeded (each request its own seed);
temperature 0.8 + top_k 50; greedy with min_tokens 128 (the model is given an EOS id, 2, which that
variant may not draw for 128 tokens: a suppression every step; the others set ignore_eos, so every
variant generates 128 tokens a request); greedy with logprobs 5; greedy again (the run-to-run
spread). Ratios are to the first greedy run of the same batch and workload.

Beside them, the sampler alone on random logits [batch, 32000] for each variant: the host wall time
of building the step's parameters and queueing the draw, and the GPU time of the draw replayed as a
CUDA graph (which also shows the draw has no host sync: capture would fail on one).
Writes <out>_sampling.json and .png next to e2e_throughput's --out.
"""

import dataclasses
import datetime
import json
import random
import time

import numpy as np
import torch

from benchmarks.method import save_figure

VARIANTS = {
    "greedy": dict(temperature=0.0, ignore_eos=True),
    "t0.8_top_p0.95_seeded": dict(temperature=0.8, top_p=0.95, ignore_eos=True),
    "t0.8_top_k50": dict(temperature=0.8, top_k=50, ignore_eos=True),
    "greedy_min_tokens128": dict(temperature=0.0, min_tokens=128),
    "greedy_logprobs5": dict(temperature=0.0, logprobs=5, ignore_eos=True),
    "greedy_again": dict(temperature=0.0, ignore_eos=True),
}
TARGETS = {"greedy_logprobs5": 0.9}  # the others: 0.95
EOS = 2
BATCHES = (32, 64)
WORKLOADS = ("backbone", "distinct")


def _params(variant: str, i: int, new: int):
    from app.protocol import SamplingParams

    kw = dict(VARIANTS[variant])
    if "seeded" in variant:
        kw["seed"] = 1000 + i
    if "min_tokens" in kw:
        kw["min_tokens"] = min(kw["min_tokens"], new)
    return SamplingParams(max_tokens=new, **kw)


def sampler_timing(batch: int, vocab: int, reps: int = 50) -> list[dict]:
    """Per variant: host ms to build the parameters and queue the draw, GPU ms of the draw (graph replay)."""
    from app.engine.sampler import draw
    from app.engine.sequence import Sequence
    from app.engine.step_sampling import Staging, step_sampling
    from app.protocol import GenerateRequest
    from benchmarks.method import time_graph

    staging, out = Staging("cuda"), []
    logits = torch.randn(batch, vocab, device="cuda") * 3
    for variant in VARIANTS:
        seqs = [
            Sequence(GenerateRequest(f"s{i}", (1,) * 128, _params(variant, i, 128)), 1000 + i, i) for i in range(batch)
        ]
        host = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            draw(logits, step_sampling(seqs, (EOS,), vocab, staging))
            host.append(time.perf_counter() - start)
        sp = step_sampling(seqs, (EOS,), vocab, staging)
        torch.cuda.synchronize()
        try:
            gpu = time_graph(lambda sp=sp: draw(logits, sp), torch.empty(0, device="cuda"), reps) / 1e3
        except Exception as exc:  # noqa: BLE001 (a host sync inside the draw fails the capture: recorded as the result)
            gpu = f"capture failed: {str(exc).splitlines()[0]}"
        out.append(dict(batch=batch, variant=variant, host_ms=1e3 * float(np.median(host)), gpu_ms=gpu))
        print(
            f"  sampler batch {batch} {variant:22s} host {out[-1]['host_ms']:.3f} ms  gpu {gpu if isinstance(gpu, str) else f'{gpu:.3f} ms'}",
            flush=True,
        )
    return out


def run(args, e2e):
    """e2e: the benchmarks.e2e_throughput module (its model, adapters, engine and workload runner)."""
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    out = args.out.with_name(args.out.stem + "_sampling.json")
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    cfg = dataclasses.replace(e2e.model_config(), eos_token_ids=(EOS,))
    weights = e2e.random_weights(cfg)
    names = e2e.adapters(cfg, args.requests)
    rows, timing = [], []
    data = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        requests=args.requests,
        lengths="128/128",
        rows=rows,
        sampler=timing,
    )
    for batch in BATCHES:
        pool = LoraPool(cfg.shape, PoolConfig(batch, 16, torch.float16, "cuda"))
        model = LlamaModel(cfg, weights, pool)
        engine, startup = e2e.engine_for(model, batch, args.requests)
        print(f"max batch {batch}: engine start {startup:.1f} s", flush=True)
        for variant in VARIANTS:  # warm-up: every kernel the variants use, at full batch
            e2e.run_workload(
                engine,
                names,
                "backbone",
                batch,
                [(16, 8)] * batch,
                random.Random(0),
                params=lambda i, new, v=variant: _params(v, i, new),
            )
        for workload in WORKLOADS:
            # a discarded full-size greedy run first: the first run of a workload pays for its cold
            # adapter loads and allocator growth (it measured 0.88x the same greedy run repeated)
            e2e.run_workload(
                engine,
                names,
                workload,
                args.requests,
                [(128, 128)] * args.requests,
                random.Random(f"{workload}{batch}"),
                params=lambda i, new: _params("greedy", i, new),
            )
            greedy = None
            for variant in VARIANTS:
                rng = random.Random(f"{workload}{batch}")  # the same prompts and adapters for every variant
                generated, wall, steps, ahead = e2e.run_workload(
                    engine,
                    names,
                    workload,
                    args.requests,
                    [(128, 128)] * args.requests,
                    rng,
                    params=lambda i, new, v=variant: _params(v, i, new),
                )
                tok_s = generated / wall
                greedy = greedy or tok_s
                rows.append(
                    dict(
                        max_batch=batch,
                        workload=workload,
                        variant=variant,
                        tok_s=tok_s,
                        ratio_to_greedy=tok_s / greedy,
                        target=TARGETS.get(variant, 0.95),
                        generated=generated,
                        wall_s=wall,
                        steps=len(steps),
                        steps_launched_ahead=ahead,
                    )
                )
                print(
                    f"  {workload:9s} {variant:22s} {tok_s:8.0f} tok/s  {tok_s / greedy:5.2f}x greedy  "
                    f"{len(steps)} steps ({ahead} launched ahead) {wall:.2f} s",
                    flush=True,
                )
        out.write_text(json.dumps(data, indent=1))
        del engine, model, pool
        torch.cuda.empty_cache()
    plot(data, out.with_suffix(".png"))
    for batch in BATCHES:  # last: a failed capture leaves the rows above saved
        timing += sampler_timing(batch, cfg.vocab_size)
        out.write_text(json.dumps(data, indent=1))
    print(f"\n{'batch':>5s} {'workload':10s} {'variant':22s} {'tok/s':>8s} {'x greedy':>8s} target")
    for r in rows:
        print(
            f"{r['max_batch']:5d} {r['workload']:10s} {r['variant']:22s} {r['tok_s']:8.0f} {r['ratio_to_greedy']:8.2f} "
            f"{r['target']:.2f}"
        )


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["max_batch"], r["workload"]) for r in data["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (b, w) in zip(axes[0], panels):
        rows = [r for r in data["rows"] if r["max_batch"] == b and r["workload"] == w]
        x = np.arange(len(rows))
        ax.bar(
            x,
            [r["ratio_to_greedy"] for r in rows],
            color=["C0" if r["variant"].startswith("greedy") else "C1" for r in rows],
        )
        for target in sorted({r["target"] for r in rows}):
            ax.axhline(target, ls="--", color="gray", lw=0.8)
        ax.set(xticks=x, title=f"max batch {b}, {w}", ylabel="tok/s ÷ greedy", ylim=(0, 1.15))
        ax.set_xticklabels([r["variant"] for r in rows], rotation=60, ha="right", fontsize=7)
    save_figure(
        fig,
        f"Sampled vs greedy decoding, Llama-2-7B shape fp16, {data['requests']} requests 128/128, {data['device']}",
        png,
    )
