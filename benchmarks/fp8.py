"""fp8 base weights against bf16 in one run: engine decode throughput and accuracy (issue 48).

On the device (H100 / H200; ~4 min on a fresh machine, most of it the kernels' first compile):
    python -m benchmarks.fp8                  # → benchmarks/results/fp8_<gpu>.json + .png
CPU smoke run of the plumbing (a tiny shape, the CPU reference GEMM): --smoke. Anywhere: --plot-only.

Speed: Llama-2-7B and Llama-3-8B shapes, random bf16 weights (benchmarks/e2e_throughput.py's
helpers), and the same weights quantized at load as `quantization: fp8` does; rank-16 adapters on
all seven projections, bf16. Per shape and max batch B in 1, 32, 64: B requests queued at once,
prompt --prompt random tokens, --new new tokens (greedy, ignore EOS), workloads backbone (no
adapter) and distinct (B adapters); bf16 then fp8 at each B, each workload run once unmeasured
(adapters loaded into their slots, graphs warm) and then --repeats times measured: tok_s is the
median run's generated tokens / wall time (decode dominates: one prefill step of B × prompt).

Accuracy (benchmarks/fp8_accuracy.py): per-layer output relative error of every fused projection
on the Llama-3-8B shape's random weights; logits cosine and greedy agreement to bf16 over
--prompts prompts × --new-acc tokens on the real SmolLM2-135M if this machine has it, else on a
random-weight SmolLM2-shaped checkpoint (`accuracy.model` says which). The real checkpoint's
figures on the CPU emulation: benchmarks/results/fp8_accuracy_cpu.json.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import random
import statistics
import time

import torch

from benchmarks import e2e_throughput as e2e
from benchmarks import fp8_accuracy as acc

RESULTS = pathlib.Path(__file__).parent / "results"
WORKLOADS = ("backbone", "distinct")
SMOLLM2 = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64, family="llama")
TINY = dict(vocab=32000, hidden=128, inter=256, layers=2, heads=2, kv_heads=1, head_dim=64, family="llama")


def use_shape(shape: dict):
    e2e.SHAPE.clear()
    e2e.SHAPE.update(shape)
    return e2e.model_config()


def fp8_weights(weights):
    """The same ModelWeights with every layer's projections quantized as loading with fp8 does."""
    from app.model.quantization import Quantization, quantize_projections

    layers = []
    for layer in weights.layers:
        proj, scale = quantize_projections(layer.proj)
        layers.append(dataclasses.replace(layer, proj=proj, scale=scale))
    return dataclasses.replace(weights, layers=layers), Quantization()


def engine(cfg, weights, batch, args):
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore
    from app.model.llama import LlamaModel

    blocks = batch * -(-(args.prompt + args.new) // 16) + 16
    config = EngineConfig(
        max_num_seqs=batch,
        max_tokens_per_step=max(2048, batch * args.prompt),
        num_kv_blocks=blocks,
        max_loras=batch,
        max_lora_rank=16,
        dtype=torch.bfloat16,
        device=args.device,
        max_model_len=args.prompt + args.new + 16,
    )
    pool = LoraPool(cfg.shape, PoolConfig(batch, 16, torch.bfloat16, args.device))
    return EngineCore(LlamaModel(cfg, weights, pool), None, None, config)


def run_once(core, names, workload: str, batch: int, args, rng) -> tuple[int, float]:
    """(generated tokens, wall seconds) of `batch` requests queued at once (e2e_throughput's
    workload assignment; its run loop synchronizes CUDA, which the CPU smoke run has not)."""
    from app.protocol import GenerateRequest, SamplingParams

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    vocab = core.runner.model.cfg.vocab_size
    sync()
    start = time.perf_counter()
    for i, a in enumerate(e2e.assignment(workload, batch, rng)):
        prompt = tuple(rng.randrange(vocab) for _ in range(args.prompt))
        req = GenerateRequest(f"{workload}{i}", prompt, params, None if a is None else f"a{a}")
        core.add(req, adapter=None if a is None else names[a])
    generated = 0
    while core.has_work():
        generated += sum(len(c.token_ids) for c in core.step() if hasattr(c, "token_ids"))
    sync()
    return generated, time.perf_counter() - start


def timed(core, names, workload, batch, args) -> dict:
    """One unmeasured run (adapters into their slots, graphs warm), then --repeats measured ones."""
    runs = []
    for k in range(args.repeats + 1):
        generated, wall = run_once(core, names, workload, batch, args, random.Random(f"{workload}{batch}{k}"))
        if k:
            runs.append(generated / wall)
    return dict(tok_s=statistics.median(runs), tok_s_runs=runs)


def speed(shape_name: str, args, rows: list) -> None:
    cfg = use_shape(e2e.SHAPES[shape_name] if shape_name in e2e.SHAPES else TINY)
    bf16 = e2e.random_weights(cfg, torch.bfloat16, args.device)
    fp8, quant = fp8_weights(bf16)
    from adapters_store.host_cache import pack

    # in the pool's dtype: no repacking per load
    names = [pack(a, dtype=torch.bfloat16) for a in e2e.adapters(cfg, max(args.batches))]
    for batch in args.batches:
        for precision, weights, c in (("bf16", bf16, cfg), ("fp8", fp8, dataclasses.replace(cfg, quantization=quant))):
            core = engine(c, weights, batch, args)
            for workload in WORKLOADS:
                r = dict(shape=shape_name, precision=precision, batch=batch, workload=workload)
                r.update(timed(core, names, workload, batch, args))
                rows.append(r)
                print(f"  {shape_name} {precision} b{batch:<3d} {workload:9s} {r['tok_s']:9.0f} tok/s", flush=True)
            del core
            if args.device == "cuda":
                torch.cuda.empty_cache()
    del bf16, fp8


def speedups(rows) -> list[dict]:
    by = {(r["shape"], r["batch"], r["workload"], r["precision"]): r["tok_s"] for r in rows}
    return [
        dict(shape=s, batch=b, workload=w, speedup=by[s, b, w, "fp8"] / by[s, b, w, "bf16"])
        for (s, b, w, p) in by
        if p == "fp8"
    ]


def accuracy(args) -> dict:
    out = {}
    cfg = use_shape(e2e.SHAPES["llama3-8b"] if not args.smoke else TINY)
    weights = e2e.random_weights(cfg, torch.bfloat16, args.device)
    out["layer_errors"] = acc.layer_errors(weights)
    out["layer_errors_shape"] = "llama3-8b (random weights)" if not args.smoke else "tiny"
    print("  per-layer relative error:", json.dumps(out["layer_errors"]), flush=True)
    del weights
    path, model, tok = smollm2(args)
    out["model"] = model
    out["logits"] = acc.run(path, args.device, args.prompts, args.new_acc, tok)
    return out


def smollm2(args):
    """(checkpoint, its description, tokenizer): the real SmolLM2 if installed, else random weights of its shape."""
    from app.engine.factory import load_tokenizer

    if not args.smoke:
        try:
            from app.model.default import default_model_dir

            path = default_model_dir()
            return path, "SmolLM2-135M-Instruct (real weights)", load_tokenizer(path)
        except RuntimeError as exc:
            print(f"  no real SmolLM2 here ({exc}): random weights of its shape", flush=True)
    path = pathlib.Path("/tmp/fp8-bench-smollm2")
    write_random_checkpoint(SMOLLM2 if not args.smoke else TINY, path)
    return path, "SmolLM2-135M shape, random weights (std 0.02)", None


def write_random_checkpoint(shape: dict, path: pathlib.Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2048,
        initializer_range=0.02,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def summary(rows, accuracy_: dict | None) -> dict:
    ups = speedups(rows)
    at32 = lambda w: min((u["speedup"] for u in ups if u["batch"] == 32 and u["workload"] == w), default=None)  # noqa: E731
    s = dict(
        speedup_b32_backbone=at32("backbone"),  # the smaller of the two shapes'
        speedup_b32_distinct=at32("distinct"),
        speedup_min=min((u["speedup"] for u in ups), default=None),
    )
    if accuracy_:
        s["logits_cosine_min"] = min(v["cosine_min"] for v in accuracy_["logits"].values())
        s["greedy_agreement_min"] = min(v["greedy_agreement"] for v in accuracy_["logits"].values())
        s["layer_rel_error_max"] = max(v["fp8"]["max"] for v in accuracy_["layer_errors"].values())
        s["logits_model"] = accuracy_["model"]
    return s


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    shapes = sorted({r["shape"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for workload, marker in zip(WORKLOADS, "os"):
            for precision, style in (("bf16", "--"), ("fp8", "-")):
                pts = sorted(
                    (r["batch"], r["tok_s"])
                    for r in data["rows"]
                    if (r["shape"], r["workload"], r["precision"]) == (shape, workload, precision)
                )
                ax.plot(*zip(*pts), style, marker=marker, label=f"{precision} {workload}")
        ax.set(title=shape, xscale="log", yscale="log", xlabel="batch size", ylabel="decode tok/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    s = data["summary"]
    save_figure(
        fig,
        f"fp8 vs bf16 on {data['gpu']}: ×{s['speedup_b32_backbone']:.2f} backbone, ×{s['speedup_b32_distinct']:.2f} "
        f"distinct at batch 32",
        png,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="accuracy: prompts")
    ap.add_argument("--new-acc", type=int, default=64, help="accuracy: bf16 greedy tokens per prompt")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny shape: the plumbing only")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.device = "cpu" if args.smoke else "cuda"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    short = next((g for g in ("H200", "H100") if g in gpu), "smoke" if args.smoke else gpu.split()[-1]).lower()
    args.out = args.out or RESULTS / f"fp8_{short}.json"
    if args.plot_only:
        return plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
    if args.smoke:
        args.shapes, args.prompts, args.new_acc, args.batches, args.new, args.repeats = "tiny", 4, 8, [1, 32], 8, 1
    data = dict(gpu=gpu, date=datetime.date.today().isoformat(), prompt=args.prompt, new=args.new, rows=[])
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        speed(shape, args, data["rows"])
    data["speedups"] = speedups(data["rows"])
    data["accuracy"] = None if args.no_accuracy else accuracy(args)
    data["summary"] = summary(data["rows"], data["accuracy"])
    data["wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    plot(data, args.out.with_suffix(".png"))
    print(json.dumps(data["summary"], indent=1))
    for u in data["speedups"]:
        print(f"  {u['shape']:10s} b{u['batch']:<3d} {u['workload']:9s} fp8/bf16 ×{u['speedup']:.2f}")


if __name__ == "__main__":
    main()
