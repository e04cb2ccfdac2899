"""Issue 46 on one GPU: what `deterministic: true` costs and what it buys (engine only).

On the device:  python -m benchmarks.determinism        (JSON + PNG: benchmarks/results/determinism_<gpu>.json)
Anywhere:       python -m benchmarks.determinism --plot-only
Plumbing check: python -m benchmarks.determinism --tiny  (a 2-layer model, CPU or GPU, no PNG)

Llama-2-7B shape, random fp16 weights, rank-16 adapters on all seven projections (the helpers of
benchmarks/e2e_throughput.py). Throughput: N requests queued at once, greedy, at max batch 32 and 64,
workloads backbone and distinct (64 requests), 128 prompt / 128 new tokens, and at max batch 32 the ShareGPT-like
mixed lengths; each cell run in the default mode and deterministic, same process, same requests;
cost = 1 - tok/s(deterministic) / tok/s(default). Identity: R requests (mixed adapters, greedy,
logprobs) generated alone one by one, all at once in one batch, and migrated (each resumed after
k of its tokens by a prefill over prompt + those tokens, all at once): identical = tokens and
logprobs bitwise equal in all three; counted in both modes. Instance invariance: a second engine
over the same weights, built after odd-sized ballast shifted every later address, runs the batch
again (default mode): bitwise equal or not.

The JSON ends with `summary`: instance_invariant, cost_max, requests, identical (deterministic),
identical_default.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import pathlib
import random
import time

import torch

from benchmarks import e2e_throughput as e2e

RESULTS = pathlib.Path(__file__).parent / "results"
TINY = dict(vocab=512, hidden=1024, inter=2816, layers=2, heads=8, kv_heads=2, head_dim=128, family="llama")


def make_engine(model, max_batch, blocks, deterministic, device, dtype):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore

    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_tokens_per_step=2048,
        num_kv_blocks=blocks,
        max_loras=max_batch,
        max_lora_rank=16,
        dtype=dtype,
        device=device,
        max_model_len=4096,
        deterministic=deterministic,
    )
    return EngineCore(model, None, None, cfg)


def run(engine, reqs, adapters, waves=None):
    """{request id: (tokens, logprobs)} and the wall seconds; waves: request index → step it joins (default 0)."""
    out, step, pending = {}, 0, list(range(len(reqs)))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine.has_work() or pending:
        for i in [i for i in pending if (waves or {}).get(i, 0) <= step]:
            pending.remove(i)
            r = reqs[i]
            engine.add(r, adapter=None if r.adapter is None else adapters[int(r.adapter[1:])])
        for c in engine.step():
            toks, lps = out.setdefault(c.request_id, ([], []))
            toks += getattr(c, "token_ids", ())
            lps += getattr(c, "logprobs", None) or ()
        step += 1
    sync()
    return out, time.perf_counter() - start


def release(engine) -> None:
    """Free an engine's KV cache before the next one allocates its own."""
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def requests(n, sizes, which, rng, logprobs=None, prefix="q"):
    from app.protocol import GenerateRequest, SamplingParams

    vocab = e2e.SHAPE["vocab"]
    return [
        GenerateRequest(
            f"{prefix}{i}",
            tuple(rng.randrange(vocab) for _ in range(p)),
            SamplingParams(max_tokens=new, temperature=0.0, logprobs=logprobs),
            None if a is None else f"a{a}",
        )
        for i, (a, (p, new)) in enumerate(zip(which, sizes))
    ]


def throughput(model, adapters, args, device, dtype, rows, save):
    cells = [(b, w, f"{args.prompt}/{args.new}") for b in args.batches for w in ("backbone", "distinct")]
    cells += [(32, "distinct", "sharegpt")] if 32 in args.batches else []
    for batch, workload, kind in cells:
        rng = random.Random(batch)
        sizes = (
            e2e.lengths(kind, args.requests, rng) if kind == "sharegpt" else [(args.prompt, args.new)] * args.requests
        )
        which = e2e.assignment(workload, args.requests, rng)
        reqs = requests(args.requests, sizes, which, rng)
        blocks = batch * -(-max(p + n for p, n in sizes) // 16) + 64
        row = dict(batch=batch, workload=workload, lengths=kind)
        for mode in (False, True):
            engine = make_engine(model, batch, blocks, mode, device, dtype)
            run(engine, reqs[: min(4, len(reqs))], adapters)  # warm: first-use allocations
            got, wall = run(engine, reqs, adapters)
            row["deterministic" if mode else "default"] = sum(len(t) for t, _ in got.values()) / wall
            release(engine)
        row["cost"] = 1 - row["deterministic"] / row["default"]
        rows.append(row)
        print(
            f"{batch:>3} {workload:<9} {kind:<8} default {row['default']:8.0f} tok/s  "
            f"deterministic {row['deterministic']:8.0f}  cost {100 * row['cost']:5.1f} %",
            flush=True,
        )
        save()


def identity_requests(args, adapters) -> tuple[list, int]:
    """The identity check's requests (every fourth on the base model, the rest over the adapters)
    and the KV blocks that hold them all at once."""
    rng = random.Random(11)
    r = args.identity_requests
    sizes = [(rng.randint(8, 200), args.identity_new) for _ in range(r)]
    which = [None if i % 4 == 0 else i % len(adapters) for i in range(r)]
    return requests(r, sizes, which, rng, logprobs=1, prefix="i"), r * -(-(200 + args.identity_new) // 16) + 64


def identity(model, adapters, args, device, dtype, mode):
    """How many of R requests are bitwise the same alone, batched and migrated."""
    reqs, blocks = identity_requests(args, adapters)
    engine = make_engine(model, len(reqs), blocks, mode, device, dtype)
    batched, _ = run(engine, reqs, adapters, waves={i: i % 5 for i in range(len(reqs))})
    alone = {q.request_id: run(engine, [q], adapters)[0][q.request_id] for q in reqs}
    k = args.identity_new // 3
    moved = [dataclasses.replace(q, resume_token_ids=tuple(alone[q.request_id][0][:k])) for q in reqs]
    migrated, _ = run(engine, moved, adapters)
    same = 0
    for q in reqs:
        a = alone[q.request_id]
        m = migrated[q.request_id]
        same += batched[q.request_id] == a and (m[0], m[1]) == (a[0][k:], a[1][k:])
    return same, batched, engine


def instance_invariant(model, adapters, args, device, dtype, first_batched):
    """A second default-mode engine, built after ballast that shifts every later address, runs the batch."""
    ballast = [torch.empty(n, dtype=torch.uint8, device=device) for n in (1 << 20 | 272, 999_983)]
    reqs, blocks = identity_requests(args, adapters)
    engine = make_engine(model, len(reqs), blocks, False, device, dtype)
    got, _ = run(engine, reqs, adapters, waves={i: i % 5 for i in range(len(reqs))})
    del ballast, engine
    return got == first_batched


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"B{r['batch']} {r['workload']}\n{r['lengths']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["default"] for r in rows], 0.4, label="default")
    ax.bar([i + 0.2 for i in x], [r["deterministic"] for r in rows], 0.4, label="deterministic: true")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("generated tok/s")
    ax.legend()
    s = data["summary"]
    save_figure(
        fig,
        f"{data['device']}: deterministic costs ≤ {100 * s['cost_max']:.0f} %; "
        f"{s['identical']}/{s['requests']} identical (default {s['identical_default']})",
        png,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--identity-requests", type=int, default=64)
    ap.add_argument("--identity-new", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: the plumbing, anywhere")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name().split()[1].lower() if cuda else "cpu"
    args.out = args.out or RESULTS / f"determinism_{gpu}{'_tiny' if args.tiny else ''}.json"
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    if args.tiny:
        e2e.SHAPE.clear()
        e2e.SHAPE.update(TINY)
    cfg = e2e.model_config()
    weights = e2e.random_weights(cfg, dtype, device)
    adapters = e2e.adapters(cfg, max(args.requests, args.identity_requests))
    slots = max(max(args.batches), args.identity_requests)
    model = LlamaModel(cfg, weights, LoraPool(cfg.shape, PoolConfig(slots, 16, dtype, device)))
    shape = "tiny" if args.tiny else e2e.SHAPE_NAME
    data = dict(
        shape=shape,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        date=datetime.date.today().isoformat(),
        requests=args.requests,
        rows=[],
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(data, indent=1))  # noqa: E731
    throughput(model, adapters, args, device, dtype, data["rows"], save)
    same_default, batched_default, engine = identity(model, adapters, args, device, dtype, False)
    release(engine)
    same, _, engine = identity(model, adapters, args, device, dtype, True)
    release(engine)
    invariant = instance_invariant(model, adapters, args, device, dtype, batched_default)
    data["summary"] = dict(
        instance_invariant=invariant,
        cost_max=max(r["cost"] for r in data["rows"]),
        requests=args.identity_requests,
        identical=same,
        identical_default=same_default,
    )
    save()
    print(json.dumps(data["summary"]), flush=True)
    if not args.tiny:
        plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
