"""Structured output's cost in the engine: generation throughput with every request constrained by a
JSON schema, with 25 % of them constrained, and with none, in one run; and the schemas' compile time.

On the device (once per machine: `../shared/device/make-bundle.sh llguidance==1.9.1`, carry
.device-wheels, start with `source .device-wheels/install.sh`):
    python -m benchmarks.structured_throughput                    # Llama-2-7B shape → structured_throughput_h200.*
    python -m benchmarks.structured_throughput --shape llama3-8b  # the 128k vocabulary
CPU smoke run (a tiny random model of the same vocabulary size): --smoke. Anywhere: --plot-only.

Engine alone (EngineCore.step loop), random fp16 weights of the shape (benchmarks/e2e_throughput.py),
base model, greedy; N requests queued at once, prompts of random tokens; max batch 32 and 64.
Variants per batch, in this order, the whole sequence run --repeats times (3) so that a drift of the
machine touches each; a row is the variant's run of median throughput, with every run's tok/s beside
it (`tok_s_runs`, the run-to-run spread):
- constrained: request i follows schema i mod 50 of benchmarks/random_schemas.py (bounded sizes) as
  response_format json_schema would; it ends where its JSON is complete (or at --max-new: "length").
  Its output lengths L_i are recorded;
- unconstrained: the same prompts, L_i tokens each (ignore_eos), no grammar: the same work;
- mix25: every 4th request constrained as above, the others L_i unconstrained tokens.
tok_s = generated tokens / wall time from queueing to the last token; ratios to `unconstrained`.
Targets (issue 36): constrained ≥ 0.9× at batch 32, mix25 ≥ 0.95×; compile p99 < 50 ms.

A real vocabulary is needed for the grammar engine: the shape's vocabulary size is given by a
synthetic tokenizer, a byte-level BPE trained on this Python's standard-library source to that size
(padded with reserved tokens if the corpus runs out of merges; "</s>" is EOS), built in seconds and
never fetched. Also reported: the grammar engine's vocabulary build, the 50 schemas' compile time
(p50/p99, cold cache, off the engine thread as in serving), the host time to fill a step's masks,
and how many steps were launched ahead (a constrained row's draw waits until the step is taken:
app/engine/run_ahead.py).
"""

import argparse
import datetime
import json
import pathlib
import sysconfig
import time

import numpy as np
import torch

from benchmarks import e2e_throughput as e2e
from benchmarks.method import save_figure
from benchmarks.random_schemas import random_schemas

TINY = dict(vocab=32000, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, family="llama")
VARIANTS = ("constrained", "unconstrained", "mix25")
TARGETS = {"constrained": 0.9, "mix25": 0.95}


def synthetic_tokenizer(vocab: int):
    """A byte-level BPE of exactly `vocab` tokens trained on the standard library's source (see above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((p.read_text(encoding="utf-8", errors="replace") for p in files), trainer)
    tok.add_special_tokens([f"<reserved_{i}>" for i in range(vocab - tok.get_vocab_size())])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def build(shape: dict, batch: int, device: str, dtype, tokenizer):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore
    from app.model.llama import LlamaModel

    e2e.SHAPE.clear()
    e2e.SHAPE.update(shape)
    cfg = e2e.model_config()
    model = LlamaModel(cfg, e2e.random_weights(cfg, dtype, device))
    config = EngineConfig(
        max_num_seqs=batch,
        max_tokens_per_step=2048,
        num_kv_blocks=batch * 48 + 64,
        dtype=dtype,
        device=device,
        max_model_len=768,
        prefix_caching=False,
    )
    return EngineCore(model, None, tokenizer, config)


def compile_times(engine, guides) -> dict:
    start = time.perf_counter()
    engine.grammars.warm()
    vocab_s = time.perf_counter() - start
    times = []
    for guide in guides:
        start = time.perf_counter()
        engine.grammars.compile(guide)
        times.append(time.perf_counter() - start)
    return {
        "vocab_build_s": vocab_s,
        "compile_ms_p50": 1e3 * float(np.percentile(times, 50)),
        "compile_ms_p99": 1e3 * float(np.percentile(times, 99)),
        "compile_ms_max": 1e3 * max(times),
    }


class MaskTimer:
    """Host time of each step's mask fill (app/engine/step_sampling.py calls grammar.fill_masks)."""

    def __init__(self):
        from app.engine import step_sampling

        self.module, self.fill, self.seconds = step_sampling, step_sampling.fill_masks, []
        step_sampling.fill_masks = self

    def __call__(self, states, vocab):
        start = time.perf_counter()
        out = self.fill(states, vocab)
        self.seconds.append(time.perf_counter() - start)
        return out


class Timed:
    """Host seconds spent in a method (patched on its class), summed: where a step's host time goes.
    StepTokens.sample is the host's wait for the step's tokens (the GPU still working); the
    grammar's advance and the mask fill are host work the GPU may wait for."""

    def __init__(self, cls, name: str):
        self.seconds, fn = 0.0, getattr(cls, name)

        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(cls, name, timed)


def run(engine, variant: str, prompts, guides, lengths, max_new: int, timer: MaskTimer, spans: dict) -> dict:
    from app.protocol import GenerateRequest, SamplingParams

    timer.seconds.clear()
    for span in spans.values():
        span.seconds = 0.0
    ahead = engine.runner.steps_taken_ahead
    for i, prompt in enumerate(prompts):
        constrained = variant == "constrained" or (variant == "mix25" and i % 4 == 0)
        params = (
            SamplingParams(max_tokens=max_new, temperature=0.0, guide=guides[i % len(guides)])
            if constrained
            else SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
        )
        engine.add(GenerateRequest(f"{variant}{i}", prompt, params))
    text, reasons, counts = {}, {}, {}
    sync = torch.cuda.synchronize if engine.config.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    steps = engine.steps
    while engine.has_work():
        for chunk in engine.step():
            counts[chunk.request_id] = counts.get(chunk.request_id, 0) + len(chunk.token_ids)
            text[chunk.request_id] = text.get(chunk.request_id, "") + chunk.text
            reasons[chunk.request_id] = chunk.finish_reason
    sync()
    wall = time.perf_counter() - start
    generated = sum(counts.values())
    out = {
        "variant": variant,
        "tok_s": generated / wall,
        "wall_s": wall,
        "generated": generated,
        "steps": engine.steps - steps,
        "steps_launched_ahead": engine.runner.steps_taken_ahead - ahead,
        "mask_fill_ms_p50": 1e3 * float(np.median(timer.seconds)) if timer.seconds else None,
        "step_ms": 1e3 * wall / max(1, engine.steps - steps),
    }
    out.update({f"{name}_ms_per_step": 1e3 * span.seconds / max(1, out["steps"]) for name, span in spans.items()})
    out["mask_fill_ms_per_step"] = 1e3 * sum(timer.seconds) / max(1, out["steps"])
    if variant == "constrained":
        out["lengths"] = [counts[f"constrained{i}"] for i in range(len(prompts))]
        out["finished_by_grammar"] = sum(reasons[f"constrained{i}"] == "stop" for i in range(len(prompts)))
        out["valid_json"] = sum(_is_json(text[f"constrained{i}"]) for i in range(len(prompts)))
    return out


def _median_run(rows: list[dict]) -> dict:
    """The run of median throughput, with every run's tok/s beside it (the spread)."""
    ranked = sorted(rows, key=lambda r: r["tok_s"])
    return {**ranked[len(ranked) // 2], "tok_s_runs": [r["tok_s"] for r in rows]}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["max_batch"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [r for r in data["rows"] if r["max_batch"] == b]
        ax.bar(range(len(rows)), [r["tok_s"] for r in rows])
        for x, r in enumerate(rows):
            ax.text(x, r["tok_s"], f"{r['ratio']:.2f}×", ha="center", va="bottom")
        ax.set(xticks=range(len(rows)), title=f"max batch {b}", ylabel="tokens / s")
        ax.set_xticklabels([r["variant"] for r in rows], fontsize=8)
    c = data["compile"]
    model = f"tiny random model, {data['shape']} vocabulary" if data["smoke"] else f"{data['shape']} shape"
    save_figure(
        fig,
        f"{model}, structured output ({data['device']}); compile p50 {c['compile_ms_p50']:.1f} ms, "
        f"p99 {c['compile_ms_p99']:.1f} ms",
        png,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(e2e.SHAPES), default="llama2-7b")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model (the shape's vocabulary)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved; the median is kept")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    name = f"structured_throughput_{'cpu_smoke' if args.smoke else 'h200'}" + (
        "" if args.shape == "llama2-7b" else f"_{args.shape}"
    )
    args.out = args.out or pathlib.Path(__file__).parent / "results" / f"{name}.json"
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    shape = dict(e2e.SHAPES[args.shape])
    if args.smoke:
        shape = dict(TINY, vocab=shape["vocab"])
        args.requests, args.batches, args.prompt, args.max_new = min(args.requests, 16), "8", 16, 96
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.float16)
    start = time.perf_counter()
    tokenizer = synthetic_tokenizer(shape["vocab"])
    print(f"synthetic tokenizer of {len(tokenizer)} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    from app.protocol import Guide

    guides = [Guide("json_schema", json.dumps(s, sort_keys=True)) for s in random_schemas(50)]
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(1, shape["vocab"], args.prompt)) for _ in range(args.requests)]
    data = dict(
        shape=args.shape,
        smoke=args.smoke,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        date=datetime.date.today().isoformat(),
        requests=args.requests,
        prompt=args.prompt,
        targets=TARGETS,
        rows=[],
    )
    timer = MaskTimer()
    from app.engine.core import EngineCore
    from app.engine.grammar import GrammarState
    from app.engine.step_tokens import StepTokens

    spans = {"step": Timed(EngineCore, "step"), "wait": Timed(StepTokens, "sample")}
    spans["advance"] = Timed(GrammarState, "advance")
    for batch in map(int, args.batches.split(",")):
        engine = build(shape, batch, device, dtype, tokenizer)
        if "compile" not in data:
            data["compile"] = compile_times(engine, guides)
            print("compile", data["compile"], flush=True)
        run(
            engine, "warmup", prompts, guides, [16] * len(prompts), args.max_new, timer, spans
        )  # untimed: first-use costs
        lengths, runs = None, {v: [] for v in VARIANTS}
        for _ in range(args.repeats):  # interleaved, so a drift of the machine touches every variant
            for variant in VARIANTS:
                row = run(engine, variant, prompts, guides, lengths, args.max_new, timer, spans)
                lengths = lengths or row.pop("lengths")
                row.pop("lengths", None)
                runs[variant].append(row)
                print({"max_batch": batch, **row}, flush=True)
        for variant, rows in runs.items():
            data["rows"].append({"max_batch": batch, **_median_run(rows)})
        base = next(r["tok_s"] for r in data["rows"] if r["max_batch"] == batch and r["variant"] == "unconstrained")
        for r in data["rows"]:
            r.setdefault("ratio", r["tok_s"] / base) if r["max_batch"] == batch else None
        del engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    plot(data, args.out.with_suffix(".png"))
    c = data["compile"]
    print(
        f"\ncompile (50 schemas): p50 {c['compile_ms_p50']:.2f} ms  p99 {c['compile_ms_p99']:.2f} ms (target < 50); "
        f"vocabulary {c['vocab_build_s']:.1f} s"
    )
    print(
        f"{'batch':>5s} {'variant':20s} {'tok/s':>8s} {'ratio':>6s} {'target':>6s} {'steps':>6s} {'ahead':>6s} {'mask ms':>8s}"
        "  runs (tok/s)   per step (ms): wall  step() wait advance masks"
    )
    for r in data["rows"]:
        mask = f"{r['mask_fill_ms_p50']:8.2f}" if r["mask_fill_ms_p50"] is not None else f"{'-':>8s}"
        target = f"{TARGETS[r['variant']]:6.2f}" if r["variant"] in TARGETS and r["max_batch"] == 32 else f"{'':6s}"
        print(
            f"{r['max_batch']:5d} {r['variant']:20s} {r['tok_s']:8.0f} {r['ratio']:6.2f} {target} {r['steps']:6d} "
            f"{r['steps_launched_ahead']:6d} {mask}  {min(r['tok_s_runs']):5.0f}-{max(r['tok_s_runs']):5.0f}   {r['step_ms']:5.2f} {r['step_ms_per_step']:5.2f} "
            f"{r['wait_ms_per_step']:5.2f} {r['advance_ms_per_step']:5.2f} {r['mask_fill_ms_per_step']:5.2f}"
        )


if __name__ == "__main__":
    main()
