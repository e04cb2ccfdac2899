"""Punica Fig. 11 on one GPU: end-to-end generation throughput of the engine by workload.

On the device:  python -m benchmarks.e2e_throughput --out benchmarks/results/e2e_throughput_h200.json
Other shapes:   python -m benchmarks.e2e_throughput --shape llama3-8b   (or qwen2.5-7b; JSON + PNG
                e2e_throughput_h200_<shape> unless --out says otherwise)
Anywhere:       python -m benchmarks.e2e_throughput --plot-only
Sampled decoding against greedy: --sampling (benchmarks/e2e_sampling.py)

Llama-2-7B shape, random fp16 weights; rank-16 adapters on all seven projections (8 distinct
random weight sets, shared by adapter names beyond 8: every name is its own pool slot and
copy, the values do not change the work); N requests queued at once, prompt 128 random
tokens, 128 new (greedy, no stop); max batch 32 and 64; at max batch 32 also ShareGPT-like
lengths (lognormal, σ 1, with ShareGPT's mean prompt 161 and output 338 tokens as the vLLM
paper (SOSP '23, §6.1) gives them, clipped to 4..1024, drawn per request and workload);
workloads backbone (no adapter), identical (one adapter), uniform (⌈√N⌉ adapters, equal
shares), skewed (Zipf 1.5 over N adapters), distinct (N adapters). tok_s = generated tokens /
wall time from queueing to the last token, adapter copies, prefill and decode all inside.

Peers in the same run: HF transformers `generate` backbone-only on one batch of max_batch
requests (same lengths), and HF + PEFT with `adapter_names` on a mixed batch of 8 adapters
(fewer new tokens: it is much slower). Roofline: for every step the engine ran, the bytes
a decode step must read (weights, each sequence's KV, that step's distinct adapters) over
the copy bandwidth measured here, plus prefill FLOPs (2·params per token + attention) over
the fp16 matmul rate measured here. benchmarks/step_profile.py gives the step-time breakdown
of full-batch decode steps (wall time; attention / GEMMs / LoRA / other from a torch profile).
"""

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import random
import sys
import time

import numpy as np
import torch

from benchmarks.hf_peers import hf_peers
from benchmarks.method import copy_bandwidth, save_figure
from benchmarks.step_profile import profile_breakdown

WORKLOADS = ("backbone", "identical", "uniform", "skewed", "distinct")
KV_BLOCKS_PER_SEQ = 128  # 2048 tokens: room for the ShareGPT-like lengths
SHAREGPT = dict(prompt=161, output=338, sigma=1.0, lo=4, hi=1024)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(vocab=32000, hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32, head_dim=128)
# --shape: real checkpoints' shapes (random weights); `family` picks the traits (Qwen2: q/k/v bias)
SHAPES = {
    "llama2-7b": dict(SHAPE, family="llama"),
    "llama3-8b": dict(
        vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, family="llama"
    ),
    "qwen2.5-7b": dict(
        vocab=152064, hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, family="qwen2"
    ),
}
SHAPE_NAME = "llama2-7b"


def model_config():
    from app.model.config import ModelConfig

    d = SHAPE["head_dim"]
    from app.model.family import FAMILIES

    family = SHAPE.get("family", "llama")
    return ModelConfig(
        SHAPE["vocab"],
        SHAPE["hidden"],
        SHAPE["inter"],
        SHAPE["layers"],
        SHAPE["heads"],
        SHAPE["kv_heads"],
        d,
        1e-5,
        False,
        4096,
        1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)),
        1.0,
        (),
        family=family,
        traits=FAMILIES[family],
    )


def random_weights(cfg, dtype=torch.float16, device="cuda"):
    from app.model.weights import LayerWeights, ModelWeights

    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device=device, generator=g) * 0.02).to(dtype)  # noqa: E731
    ones = lambda: (1 + 0.1 * torch.randn(cfg.hidden_size, device=device, generator=g)).to(dtype)  # noqa: E731
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    layers = [
        LayerWeights(
            ones(),
            ones(),
            {"qkv": rnd(q + 2 * kv, h), "o": rnd(h, q), "gate_up": rnd(2 * i, h), "down": rnd(h, i)},
            bias={"qkv": rnd(q + 2 * kv)} if cfg.traits.qkv_bias else {},
        )
        for _ in range(cfg.num_layers)
    ]
    return ModelWeights(rnd(cfg.vocab_size, h), rnd(cfg.vocab_size, h), ones(), layers)


def adapters(cfg, names: int, rank=16, distinct=8):
    """`names` LoraWeights: `distinct` random weight sets packed once (pinned fp16), then named."""
    from adapters_store.host_cache import pack
    from adapters_store.manifest import AdapterManifest
    from adapters_store.peft_weights import LoraWeights

    g = torch.Generator().manual_seed(1)
    sets = []
    for k in range(min(distinct, names)):
        tensors = {
            (layer, m): (torch.randn(rank, d_in, generator=g) * 0.01, torch.randn(d_out, rank, generator=g) * 0.01)
            for layer in range(cfg.num_layers)
            for m, (d_in, d_out) in cfg.module_dims.items()
        }
        w = LoraWeights(f"w{k}", "1", AdapterManifest(rank, 2.0 * rank, False, MODULES), tensors)
        sets.append(pack(w, dtype=torch.float16))
    return [dataclasses.replace(sets[k % len(sets)], name=f"a{k}") for k in range(names)]


def assignment(workload: str, n: int, rng: random.Random) -> list[int | None]:
    """Adapter index of each request (None: the base model)."""
    if workload == "backbone":
        return [None] * n
    if workload == "identical":
        return [0] * n
    if workload == "uniform":
        k = math.ceil(math.sqrt(n))
        out = [i % k for i in range(n)]
        rng.shuffle(out)
        return out
    if workload == "distinct":
        return list(range(n))
    weights = [1 / (i + 1) ** 1.5 for i in range(n)]  # skewed: Zipf 1.5
    return rng.choices(range(n), weights, k=n)


class StepLog:
    """What each engine step computed, for the roofline: decode rows' contexts and adapters, prefill tokens."""

    def __init__(self, runner):
        self.steps, self._step = [], runner.step
        runner.step = self.step

    def step(self, scheduled):
        decode = [(s.num_computed + 1, s.lora_slot) for s, n in scheduled if n == 1]
        prefill = [(s.num_computed, n) for s, n in scheduled if n > 1]
        self.steps.append((decode, prefill))
        return self._step(scheduled)


def roofline_seconds(steps, cfg, bandwidth, flops_rate, adapter_bytes):
    d, layers = cfg.head_dim, cfg.num_layers
    params = sum(SHAPE_PARAMS(cfg).values()) - cfg.vocab_size * cfg.hidden_size  # the embedding is a gather
    weight_bytes = 2 * params
    kv_token = 2 * layers * cfg.num_kv_heads * d * 2  # K and V, fp16
    t = 0.0
    for decode, prefill in steps:
        if decode:
            distinct = len({slot for _, slot in decode if slot >= 0})
            t += (weight_bytes + kv_token * sum(c for c, _ in decode) + distinct * adapter_bytes) / bandwidth
        for done, n in prefill:
            attn = 4 * layers * cfg.num_heads * d * n * (done + n / 2)
            t += (2 * params * n + attn) / flops_rate
    return t


def SHAPE_PARAMS(cfg):  # noqa: N802
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return {"embed": cfg.vocab_size * h, "lm_head": cfg.vocab_size * h, "layers": cfg.num_layers * layer}


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start)


def engine_for(model, max_batch, num_requests):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore

    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_tokens_per_step=2048,
        num_kv_blocks=max_batch * KV_BLOCKS_PER_SEQ + 64,
        max_loras=max_batch,
        max_lora_rank=16,
        dtype=torch.float16,
        device="cuda",
        max_model_len=4096,
    )
    start = time.perf_counter()
    engine = EngineCore(model, None, None, cfg)
    return engine, time.perf_counter() - start


def lengths(kind: str, n: int, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, new tokens) of each request: "128/128", or "sharegpt" (see the module docstring)."""
    if kind == "128/128":
        return [(128, 128)] * n
    g = SHAREGPT

    def draw(mean):
        return min(g["hi"], max(g["lo"], round(rng.lognormvariate(math.log(mean) - g["sigma"] ** 2 / 2, g["sigma"]))))

    return [(draw(g["prompt"]), draw(g["output"])) for _ in range(n)]


def run_workload(engine, pool_adapters, workload, n, sizes, rng, params=None):
    """params(i, new tokens) -> request i's SamplingParams (default: greedy, no stop)."""
    from app.protocol import GenerateRequest, SamplingParams

    params = params or (lambda i, new: SamplingParams(max_tokens=new, temperature=0.0))

    log = StepLog(engine.runner)
    which = assignment(workload, n, rng)
    ahead_before = engine.runner.steps_taken_ahead
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, (a, (prompt, new)) in enumerate(zip(which, sizes)):
        req = GenerateRequest(
            f"{workload}{i}",
            tuple(rng.randrange(32000) for _ in range(prompt)),
            params(i, new),
            None if a is None else f"a{a}",
        )
        engine.add(req, adapter=None if a is None else pool_adapters[a])
    generated = 0
    while engine.has_work():
        generated += sum(len(c.token_ids) for c in engine.step() if hasattr(c, "token_ids"))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    engine.runner.step = log._step
    return generated, wall, log.steps, engine.runner.steps_taken_ahead - ahead_before


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(
        {(r["max_batch"], r["lengths"]) for r in data["rows"] if r["system"] == "loraplex"},
        key=lambda p: (p[1] != "128/128", p[0]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (b, kind) in zip(axes[0], panels):
        ours = [r for r in data["rows"] if r["system"] == "loraplex" and r["max_batch"] == b and r["lengths"] == kind]
        x = np.arange(len(ours))
        ax.bar(x - 0.2, [r["tok_s"] for r in ours], 0.4, label="loraplex")
        ax.bar(x + 0.2, [r["roofline_tok_s"] for r in ours], 0.4, label="roofline", alpha=0.5)
        for r in data["rows"]:
            if r["system"] != "loraplex" and r["max_batch"] == b and r["lengths"] == kind:
                ax.axhline(
                    r["tok_s"],
                    ls="--",
                    color="gray" if r["system"] == "hf" else "red",
                    label=f"{r['system']} {r['workload']}",
                )
        ax.set(xticks=x, title=f"max batch {b}, prompt / new {kind}", ylabel="tokens / s")
        ax.set_xticklabels([r["workload"] for r in ours])
        ax.legend(fontsize=7)
    save_figure(
        fig, f"{data.get('shape', 'llama2-7b')} shape fp16, rank 16, {data['requests']} requests, {data['device']}", png
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "e2e_throughput_h200.json"
    )
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--sharegpt-batches", default="32", help="max batches that also run ShareGPT-like lengths")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument(
        "--sampling", action="store_true", help="sampled vs greedy decoding instead (benchmarks/e2e_sampling.py)"
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default=SHAPE_NAME, help="model shape (random weights)")
    args = ap.parse_args()
    if args.shape != SHAPE_NAME:
        SHAPE.clear()
        SHAPE.update(SHAPES[args.shape])
        if args.out == ap.get_default("out"):
            args.out = args.out.with_name(f"e2e_throughput_h200_{args.shape}.json")
    if args.sampling:
        from benchmarks import e2e_sampling

        e2e_sampling.run(args, sys.modules[__name__])
        return
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, fp16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    cfg = model_config()
    weights = random_weights(cfg)
    names = adapters(cfg, args.requests)
    adapter_bytes = 2 * 16 * sum(i + o for i, o in cfg.module_dims.values()) * cfg.num_layers
    rows, breakdown, capture = [], [], {}
    data = dict(
        shape=args.shape,
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        requests=args.requests,
        copy_bandwidth_Bps=bw,
        matmul_flops=rate,
        startup=capture,
        breakdown=breakdown,
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(data, indent=1))  # noqa: E731  (after every part)
    sharegpt_batches = {int(b) for b in args.sharegpt_batches.split(",") if b}
    for batch in map(int, args.batches.split(",")):
        pool = LoraPool(cfg.shape, PoolConfig(batch, 16, torch.float16, "cuda"))
        model = LlamaModel(cfg, weights, pool)
        engine, startup = engine_for(model, batch, args.requests)
        capture[batch] = {"engine_start_s": startup, "graph_capture_s": engine.runner.graphs.capture_seconds}
        print(f"max batch {batch}: engine start {startup:.1f} s (graphs {capture[batch]['graph_capture_s']:.1f} s)")
        for kind in ("128/128", "sharegpt") if batch in sharegpt_batches else ("128/128",):
            for workload in WORKLOADS:
                rng = random.Random(f"{workload}{batch}{kind}")
                sizes = lengths(kind, args.requests, rng)
                generated, wall, steps, ahead = run_workload(engine, names, workload, args.requests, sizes, rng)
                roof = generated / roofline_seconds(steps, cfg, bw, rate, adapter_bytes)
                rows.append(
                    dict(
                        system="loraplex",
                        workload=workload,
                        max_batch=batch,
                        tok_s=generated / wall,
                        roofline_tok_s=roof,
                        lengths=kind,
                        steps=len(steps),
                        steps_launched_ahead=ahead,
                        wall_s=wall,
                        mean_prompt=float(np.mean([p for p, _ in sizes])),
                        mean_new=float(np.mean([n for _, n in sizes])),
                    )
                )
                print(
                    f"  {kind:8s} {workload:9s} {generated / wall:8.0f} tok/s  roofline {roof:8.0f}  "
                    f"({100 * generated / wall / roof:.0f} %)  {len(steps)} steps ({ahead} launched ahead) {wall:.2f} s",
                    flush=True,
                )
            save()
        for workload in ("backbone", "identical", "distinct"):
            rng = random.Random(5)
            breakdown.append(profile_breakdown(engine, names, workload, assignment(workload, batch, rng), rng))
            print("  profile", breakdown[-1], flush=True)
        save()
        del engine, model, pool
        torch.cuda.empty_cache()
    del weights
    torch.cuda.empty_cache()
    for batch in map(int, args.batches.split(",")):
        for system, workload, tok_s in hf_peers(cfg, batch, 128, 128, 16, MODULES):
            rows.append(
                dict(
                    system=system,
                    workload=workload,
                    max_batch=batch,
                    tok_s=tok_s,
                    roofline_tok_s=None,
                    lengths="128/128",
                )
            )
            print(f"  {system:8s} {workload:9s} batch {batch}: {tok_s:8.0f} tok/s", flush=True)
    save()
    plot(data, args.out.with_suffix(".png"))
    print(f"\n{'system':9s} {'workload':10s} {'lengths':8s} {'batch':>5s} {'tok/s':>8s} {'roofline':>9s} {'%':>4s}")
    for r in rows:
        roof = (
            f"{r['roofline_tok_s']:9.0f} {100 * r['tok_s'] / r['roofline_tok_s']:4.0f}" if r["roofline_tok_s"] else ""
        )
        print(
            f"{r['system']:9s} {r['workload']:10s} {r.get('lengths', '128/128'):8s} {r['max_batch']:5d} {r['tok_s']:8.0f} {roof}"
        )


if __name__ == "__main__":
    main()
