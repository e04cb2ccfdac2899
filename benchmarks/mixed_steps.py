"""Steps that carry prefills (issue 44): where a mixed step's time goes, beside its floor, and what
it does to throughput on vLLM's default serving workload and on chat-like mixed lengths.

On the device:  python -m benchmarks.mixed_steps          (JSON + PNG: results/mixed_steps_<gpu>.*)
Anywhere:       python -m benchmarks.mixed_steps --tiny   (CPU, a tiny model: the plumbing only)

Parts (random fp16 weights; greedy, every request to its full length):
- breakdown: Llama-3-8B shape; one step of P prefill tokens (requests of 1,024) and D decode rows
  (context 1,088), built directly on the engine's runner. Wall time (synchronized), the host's time to
  enqueue the step (GPU idle at its start, so this is the CPU time between launches), the GPU time per
  kernel category (torch profiler), the decode step of D rows alone (its CUDA graph), and the floors:
  GEMM FLOPs and prefill attention FLOPs over the measured matmul rate, decode KV bytes over the
  measured copy bandwidth.
- vllm: Llama-3-8B shape, N prompts of 1,024 random tokens, 128 new, all queued at once, max batch 256,
  at each token budget (EngineConfig.max_tokens_per_step). floor: each step's compute over the
  measured matmul rate plus its decode rows' KV bytes over the copy bandwidth (benchmarks/e2e_throughput.py).
- chat: Llama-2-7B shape, max batch 64: 128/128 in waves, and chat-like lengths (prompt lognormal median
  180, clipped 16..1,536; output median 110, clipped 8..512), backbone and distinct adapters.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import pathlib
import random
import time

import numpy as np
import torch

from benchmarks import e2e_throughput as e2e

CATS = ("gemm", "prefill_attn", "decode_attn", "kv_gather", "lora", "copies", "other")
TINY = dict(vocab=32000, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, family="llama")


def _cat(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n:
        return "prefill_attn"
    if "paged_decode" in n:
        return "decode_attn"
    if "sgmv" in n:
        return "lora"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if "index" in n or "gather" in n:
        return "kv_gather"
    if "memcpy" in n or "memset" in n:
        return "copies"
    return "other"


def free(*objs):
    """Drop engines (their KV caches, graphs) before the next one is built."""
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def build_engine(model, max_batch, budget, kv_blocks, device, dtype, max_len=2048, **over):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore

    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_tokens_per_step=budget,
        num_kv_blocks=kv_blocks,
        max_loras=max(max_batch, 1),
        max_lora_rank=16,
        dtype=dtype,
        device=device,
        max_model_len=max_len,
        **over,
    )
    return EngineCore(model, None, None, cfg)


def fake_step(engine, prefill: int, decode: int, ctx: int, rng, prompt=1024):
    """A schedule of `prefill` tokens (requests of `prompt`, the last one cut) and `decode` rows at
    context `ctx`, its blocks allocated; returns (schedule, sequences to free)."""
    from app.engine.sequence import Sequence
    from app.protocol import GenerateRequest, SamplingParams

    bs, out, seqs = engine.config.block_size, [], []
    vocab = engine.model.cfg.vocab_size
    sizes = [prompt] * (prefill // prompt) + ([prefill % prompt] if prefill % prompt else [])
    for i, n in enumerate(sizes + [None] * decode):
        length = ctx if n is None else prompt
        req = GenerateRequest(f"f{i}", tuple(rng.randrange(vocab) for _ in range(length)), SamplingParams(max_tokens=4))
        seq = Sequence(req, 0, i)
        seq.num_computed = length - 1 if n is None else 0
        seq.block_table = engine.allocator.allocate(math.ceil(length / bs))
        seqs.append(seq)
        out.append((seq, 1 if n is None else n))
    return out, seqs


def time_call(fn, device, reps):
    """(median wall ms synchronized, median host ms to return with the device idle at the start)."""
    walls, hosts = [], []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    return 1e3 * float(np.median(walls)), 1e3 * float(np.median(hosts))


def gpu_categories(fn, device, reps=3):
    if torch.device(device).type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    cats = dict.fromkeys(CATS, 0.0)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            cats[_cat(e.name)] += e.device_time_total / 1e3 / reps
    return cats


def step_floors(cfg, prefill, decode, ctx, bw, rate, prompt=1024):
    params = e2e.SHAPE_PARAMS(cfg)["layers"]
    d, layers = cfg.head_dim, cfg.num_layers
    rows = (prefill // prompt) + bool(prefill % prompt) + decode
    gemm = (2 * params * (prefill + decode) + 2 * cfg.vocab_size * cfg.hidden_size * rows) / rate
    attn_flops = 4 * layers * cfg.num_heads * d * sum(n * n / 2 for n in [prompt] * (prefill // prompt))
    kv_bytes = 2 * layers * cfg.num_kv_heads * d * 2 * decode * ctx
    weights = 2 * (params + cfg.vocab_size * cfg.hidden_size)
    return {
        "gemm_ms": 1e3 * gemm,
        "prefill_attn_ms": 1e3 * attn_flops / rate,
        "decode_attn_ms": 1e3 * kv_bytes / bw,
        "weights_read_ms": 1e3 * weights / bw,
        "prefill_flops_ms_at_70pct_peak": 1e3 * (2 * params * prefill + attn_flops) / (0.7 * PEAK[0]),
    }


PEAK = [989e12]  # dense fp16/bf16 of an H100 SXM (the target 3); the H200 has the same


def _pin(pool, adapters, n):
    """Slots for n rows, one adapter each (Distinct), their copies done."""
    slots = [pool.acquire(adapters[i % len(adapters)]) for i in range(n)]
    while not all(pool.ready(s) for s in slots):
        time.sleep(0.01)
    return slots


def breakdown(engine, bw, rate, shapes, reps, device, ctx, adapters=None):
    """adapters: each row its own (Distinct), else the base model."""
    rows, rng = [], random.Random(0)
    cfg = engine.model.cfg
    runner = engine.runner
    m, c = engine.model, engine.config
    from app.engine.batch import build_step

    for prefill, decode in shapes:
        sched, seqs = fake_step(engine, prefill, decode, ctx, rng)
        if adapters:
            for seq, slot in zip(seqs, _pin(m.lora_pool, adapters, len(seqs))):
                seq.lora_slot = slot
        run = lambda: runner.run(sched)  # noqa: E731
        got = run()[0].clone()
        want = m.forward(build_step(sched, m.lora_pool, c.block_size, c.device, m.cfg.num_kv_heads)[0], engine.kv)
        # the step as run (graph pieces where they serve it) against the eager forward
        check = dict(
            rel_err=float((got - want).norm() / want.norm()),
            argmax_equal=float((got.argmax(-1) == want.argmax(-1)).float().mean()),
            finite=bool(torch.isfinite(got).all()),
            mixed_graphs=getattr(runner, "mixed", None) is not None
            and runner.mixed.buckets[-1] >= sum(n for _, n in sched),
        )
        wall, host = time_call(run, device, reps)
        build = lambda: build_step(sched, m.lora_pool, c.block_size, c.device, m.cfg.num_kv_heads)  # noqa: E731
        _, host_build = time_call(build, device, reps)
        cats = gpu_categories(run, device)
        dec_only = None
        if decode and runner.graphs is not None and decode <= runner.graphs.max_batch:
            order = sorted([s for s, n in sched if n == 1], key=lambda s: s.lora_slot)
            dec_only, _ = time_call(lambda: runner.graphs.run(order), device, reps)
        for i, s in enumerate(seqs):
            engine.allocator.free(s.block_table)
            if adapters:
                a = adapters[i % len(adapters)]
                m.lora_pool.release((a.name, a.version))
        row = dict(
            adapters="distinct" if adapters else "backbone",
            prefill=prefill,
            decode=decode,
            ctx=ctx,
            wall_ms=wall,
            host_enqueue_ms=host,
            host_build_ms=host_build,
            decode_step_ms=dec_only,
        )
        row.update({f"{k}_ms": v for k, v in cats.items()})
        row["gpu_busy_ms"] = sum(cats.values()) if cats else None
        row["floor"] = step_floors(cfg, prefill, decode, ctx, bw, rate)
        row["check"] = check
        if dec_only is not None:
            row["target3_ms"] = dec_only + row["floor"]["prefill_flops_ms_at_70pct_peak"]
        rows.append(row)
        print("  step", json.dumps(row), flush=True)
    return rows


CTX = 1088


def vllm_workload(model, n, budgets, batch, device, dtype, bw, rate, tiny, over):
    rows, cfg = [], model.cfg
    prompt, new = (1024, 128) if not tiny else (48, 8)
    kv_blocks = batch * math.ceil((prompt + new) / 16) + 64
    engine = build_engine(model, batch, budgets[0], kv_blocks, device, dtype, **_cfg(over))
    data_startup = startup_row("llama3-8b", engine, over)
    print("  vllm engine", data_startup, flush=True)
    e2e.run_workload(engine, [], "backbone", 4, [(prompt, 4)] * 4, random.Random(1))  # first-use costs out
    for budget in budgets:
        # one engine (one graph capture, one KV cache): the scheduler reads the budget from its config
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_tokens_per_step=budget)
        rng = random.Random(7)
        generated, wall, steps, ahead = e2e.run_workload(engine, [], "backbone", n, [(prompt, new)] * n, rng)
        floor = generated / e2e.roofline_seconds(steps, cfg, bw, rate, 0)
        mixed = sum(1 for d, p in steps if p)
        rows.append(
            dict(
                budget=budget,
                requests=n,
                tok_s=generated / wall,
                floor_tok_s=floor,
                steps=len(steps),
                mixed_steps=mixed,
            )
        )
        rows[-1].update(steps_ahead=ahead, wall_s=wall, **over)
        print(
            f"  vllm budget {budget} {over}: {generated / wall:7.0f} tok/s floor {floor:7.0f} "
            f"({100 * generated / wall / floor:.0f} %) {len(steps)} steps, {mixed} mixed, {wall:.1f} s",
            flush=True,
        )
    free(engine)
    return rows


def chat_lengths(n, rng, tiny):
    def draw(median, sigma, lo, hi):
        return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))

    if tiny:
        return [(draw(12, 0.8, 4, 40), draw(6, 0.7, 2, 16)) for _ in range(n)]
    return [(draw(180, 0.88, 16, 1536), draw(110, 0.75, 8, 512)) for _ in range(n)]


def chat(engine, names, n_wave, n_chat, tiny, over):
    rows = []
    e2e.run_workload(engine, names, "backbone", 4, [(16, 4)] * 4, random.Random(1))
    for workload in ("backbone", "distinct"):
        for kind in ("wave", "chat"):
            rng = random.Random(f"{workload}{kind}")
            n = n_wave if kind == "wave" else n_chat
            sizes = [(128, 128) if not tiny else (16, 8)] * n if kind == "wave" else chat_lengths(n, rng, tiny)
            generated, wall, steps, ahead = e2e.run_workload(engine, names, workload, n, sizes, rng)
            mixed = sum(1 for d, p in steps if p)
            rows.append(
                dict(
                    workload=workload,
                    lengths=kind,
                    requests=n,
                    tok_s=generated / wall,
                    steps=len(steps),
                    mixed_steps=mixed,
                    steps_ahead=ahead,
                    ms_per_step=1e3 * wall / len(steps),
                    **over,
                )
            )
            print(
                f"  chat {workload} {kind} {over}: {generated / wall:7.0f} tok/s, {len(steps)} steps ({mixed} mixed, "
                f"{ahead} ahead), {1e3 * wall / len(steps):.1f} ms/step",
                flush=True,
            )
    del engine
    return rows


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    bd = [r for r in data["breakdown"] if r.get("gpu_busy_ms") is not None]
    ax = axes[0]
    x = np.arange(len(bd))
    bottom = np.zeros(len(bd))
    for c in CATS:
        v = np.array([r[f"{c}_ms"] for r in bd])
        ax.bar(x, v, 0.6, bottom=bottom, label=c)
        bottom += v
    ax.plot(x, [r["wall_ms"] for r in bd], "k_", ms=20, label="wall")
    ax.set(xticks=x, ylabel="ms", title="mixed step: GPU time by kernel, wall")
    ax.set_xticklabels([f"P{r['prefill']}\nD{r['decode']}" for r in bd], fontsize=7)
    ax.legend(fontsize=6)
    ax = axes[1]
    v = data["vllm"]
    ax.bar(np.arange(len(v)) - 0.2, [r["tok_s"] for r in v], 0.4, label="tok/s")
    ax.bar(np.arange(len(v)) + 0.2, [r["floor_tok_s"] for r in v], 0.4, label="floor", alpha=0.5)
    ax.axhline(5333, ls="--", color="red", label="vLLM 0.23 (published)")
    ax.set(xticks=np.arange(len(v)), title="vLLM workload, batch 256", ylabel="output tok/s")
    ax.set_xticklabels([f"{r['budget']}\n{r.get('mixed_graphs', '')}" for r in v], fontsize=7)
    ax.legend(fontsize=6)
    save_figure(fig, f"mixed steps, {data['device']}", png)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes: the plumbing only")
    ap.add_argument("--parts", default="breakdown,vllm,chat")
    ap.add_argument("--vllm-requests", type=int, default=1000)
    ap.add_argument("--budgets", default="2048,4096,8192")
    ap.add_argument("--chat-requests", type=int, default=512)
    ap.add_argument("--wave-requests", type=int, default=256)
    ap.add_argument(
        "--variants",
        default="{}",
        help='JSON list of EngineConfig overrides to compare, e.g. [{"mixed_graphs": false}, {"mixed_graphs": true}]',
    )
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    tiny = args.tiny
    if tiny:  # e2e's helpers synchronize CUDA unconditionally
        torch.cuda.synchronize = lambda *a: None
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.float16)
    variants = json.loads(args.variants)
    variants = variants if isinstance(variants, list) else [variants]
    gpu = "cpu" if tiny else ("h200" if "H200" in torch.cuda.get_device_name() else "h100")
    out = args.out or pathlib.Path(__file__).parent / "results" / f"mixed_steps_{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    if tiny:
        bw, rate = 1e11, 1e12
    else:
        from benchmarks.method import copy_bandwidth

        bw, rate = copy_bandwidth(), e2e.matmul_rate()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    data = dict(
        device="cpu" if tiny else torch.cuda.get_device_name(),
        gpu=gpu,
        date=datetime.date.today().isoformat(),
        copy_bandwidth_Bps=bw,
        matmul_flops=rate,
        breakdown=[],
        startup=[],
        vllm=[],
        chat=[],
    )
    save = lambda: out.write_text(json.dumps(data, indent=1))  # noqa: E731
    parts = args.parts.split(",")

    def guarded(what, over, fn):
        """One part of one variant; a failure is recorded and the rest still runs."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (a device run's other parts are worth keeping)
            import traceback

            traceback.print_exc()
            data.setdefault("errors", []).append(dict(part=what, variant=over, error=repr(exc)))
        free()
        save()

    e2e.SHAPE.clear()
    e2e.SHAPE.update(TINY if tiny else e2e.SHAPES["llama3-8b"])
    cfg8 = e2e.model_config()
    llama3 = lambda: LlamaModel(cfg8, e2e.random_weights(cfg8, dtype, device))  # noqa: E731 (made per part: 80 GB cards)
    if "breakdown" in parts:
        shapes = [(1984, 64), (1792, 256), (448, 64)] if not tiny else [(48, 4), (16, 2)]
        for over in variants:

            def run_breakdown(over=over):
                engine = build_engine(
                    llama3(), 256 if not tiny else 8, 8192, 256 * 72 + 512, device, dtype, **_cfg(over)
                )
                data["startup"].append(startup_row("llama3-8b", engine, over))
                for r in breakdown(engine, bw, rate, shapes, 3 if tiny else 5, device, CTX):
                    data["breakdown"].append(dict(r, shape="llama3-8b", **over))

            guarded("breakdown", over, run_breakdown)
    if "chat" in parts:
        e2e.SHAPE.clear()
        e2e.SHAPE.update(TINY if tiny else e2e.SHAPES["llama2-7b"])
        cfg = e2e.model_config()
        batch = 64 if not tiny else 4
        weights = e2e.random_weights(cfg, dtype, device)
        names = e2e.adapters(cfg, max(args.chat_requests, args.wave_requests) if not tiny else 16)
        n_wave, n_chat = (args.wave_requests, args.chat_requests) if not tiny else (8, 12)
        for over in variants:

            def run_chat(over=over):
                pool = LoraPool(cfg.shape, PoolConfig(batch, 16, dtype, device))
                model = LlamaModel(cfg, weights, pool)
                # 80 blocks of 16 a request on average (longer ones preempt the newest): fits an 80 GB card
                engine = build_engine(model, batch, 2048, batch * 80 + 64, device, dtype, **_cfg(over))
                data["startup"].append(startup_row("llama2-7b", engine, over))
                shapes = [(256, 63), (1024, 32)] if not tiny else [(16, 2)]
                for adapters in (None, names):
                    for r in breakdown(
                        engine, bw, rate, shapes, 3 if tiny else 5, device, 320 if not tiny else 24, adapters
                    ):
                        data["breakdown"].append(dict(r, shape="llama2-7b", **over))
                if n_chat:  # 0: the step breakdown only
                    data["chat"].extend(chat(engine, names, n_wave, n_chat, tiny, over))

            guarded("chat", over, run_chat)
        del weights, names
    if "vllm" in parts:
        for over in variants:
            budgets = over.get("_budgets") or [int(b) for b in args.budgets.split(",")]
            n = args.vllm_requests if not tiny else 12

            def run_vllm(over=over, budgets=budgets, n=n):
                batch = 256 if not tiny else 4
                data["vllm"].extend(vllm_workload(llama3(), n, budgets, batch, device, dtype, bw, rate, tiny, over))

            guarded("vllm", over, run_vllm)
    summarize(data)
    save()
    plot(data, out.with_suffix(".png"))
    print(json.dumps(data["summary"], indent=1))


def _cfg(over: dict) -> dict:
    """A variant's EngineConfig fields (keys starting with _ are the benchmark's own)."""
    return {k: v for k, v in over.items() if not k.startswith("_")}


def startup_row(shape, engine, over):
    r = engine.runner
    mixed = getattr(r, "mixed", None)
    return dict(
        shape=shape,
        decode_graph_capture_s=r.graphs.capture_seconds if r.graphs is not None else None,
        mixed_capture_s=mixed.capture_seconds if mixed is not None else None,
        mixed_buckets=mixed.buckets if mixed is not None else None,
        gpu_reserved_gib=torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None,
        **over,
    )


def summarize(data):
    best = max(data["vllm"], key=lambda r: r["tok_s"], default=None)
    ratio = []
    for w in ("backbone", "distinct"):
        last = {r["lengths"]: r["tok_s"] for r in data["chat"] if r["workload"] == w}  # the last variant's
        ratio.append(last["chat"] / last["wave"] if len(last) == 2 else None)
    data["summary"] = dict(
        gpu=data["gpu"],
        vllm_workload_tok_s=best and best["tok_s"],
        floor_tok_s=best and best["floor_tok_s"],
        floor_fraction=best and best["tok_s"] / best["floor_tok_s"],
        vllm_workload_budget=best and best["budget"],
        mixed_over_wave=ratio,
    )


if __name__ == "__main__":
    main()
