"""Tokens/s of the loraplex engine vs HF transformers `generate` (+ PEFT) on the
default model, on this CPU: batch 1 and batch 16 (mixed adapters: PEFT's
`adapter_names` mixed-batch inference). Greedy, 64 new tokens, EOS ignored on
both sides so every request generates the same number of tokens. Beside each
case, in the same run: the goal, and two ceilings no engine can pass on this
machine (see ``ceilings``).

    python -m benchmarks.cpu_generate [--new-tokens 64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from adapters_store.sources import local_adapters
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.generate import EXAMPLE_ADAPTERS
from app.model.default import default_model_dir
from app.protocol import GenerateRequest, SamplingParams

GOALS = {1: 2.0, 16: 5.0}  # the goal: this many times HF's tokens/s at this batch
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a short poem about the sea.",
    "How do airplanes fly?",
]


def _prompts(tok, n):
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tok(chats[i % len(chats)])["input_ids"] for i in range(n)]


def bench_engine(engine, prompts, adapters, new_tokens):
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add(GenerateRequest(f"b{i}", tuple(p), params, a))
    start, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(c.token_ids) for c in engine.step() if hasattr(c, "token_ids"))
    return produced / (time.perf_counter() - start)


def _hf_model(adapter_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if not adapter_dirs:
        return model.eval()
    from peft import PeftModel

    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(model, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model.eval()


def bench_hf(model, tok, prompts, adapters, new_tokens):
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    kw = {} if all(a is None for a in adapters) else {"adapter_names": [a or "__base__" for a in adapters]}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            **kw,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


def _best_s(fn, reps=5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def ceilings(model, batch: int) -> dict:
    """Upper bounds on decode tokens/s at this batch on this machine, whatever the engine:
    blas: one step's weight matmuls alone (x @ W.T for every projection and the LM head,
    through the same BLAS as HF and the engine), timed here; stream: the weights' bytes
    over the measured read bandwidth (a perfect kernel at batch 1)."""
    weights = [w for layer in model.w.layers for w in layer.proj.values()] + [model.w.lm_head]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    matmuls_s = _best_s(lambda: [xs[w.shape[1]] @ w.T for w in weights])
    big = torch.ones(2**27)  # 512 MiB: far beyond the caches
    read_GBps = big.numel() * 4 / _best_s(big.sum) / 1e9
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    return {
        "blas_ceiling_tok_s": round(batch / matmuls_s, 1),
        "stream_ceiling_tok_s": round(batch / (weight_bytes / (read_GBps * 1e9)), 1),
        "read_GBps": round(read_GBps, 1),
    }


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['case']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["hf_tok_s"] for r in rows], 0.4, label="HF transformers + PEFT")
    ax.bar([i + 0.2 for i in x], [r["engine_tok_s"] for r in rows], 0.4, label="loraplex engine")
    ax.scatter(x, [r["goal_tok_s"] for r in rows], marker="_", s=900, color="k", label="goal")
    ax.scatter(
        x,
        [r["blas_ceiling_tok_s"] for r in rows],
        marker="x",
        color="r",
        label="ceiling: the step's matmuls alone (this BLAS)",
    )
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens / s")
    ax.set_title("SmolLM2-135M on this CPU, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    adapter_dirs = local_adapters(EXAMPLE_ADAPTERS)
    engine = build_engine(None, EngineConfig(max_lora_rank=64, max_loras=4, num_kv_blocks=1024), adapter_dirs)
    tok = engine.tokenizer
    mix = [None, *adapter_dirs]
    cases = {
        "batch 1 (base)": [None],
        "batch 1 (adapter)": [mix[1]],
        "batch 16 (mixed)": [mix[i % len(mix)] for i in range(16)],
    }
    rows = []
    for case, adapters in cases.items():
        prompts = _prompts(tok, len(adapters))
        bench_engine(engine, prompts[:1], adapters[:1], 4)  # warm-up
        ours = bench_engine(engine, prompts, adapters, a.new_tokens)
        used = {n: adapter_dirs[n] for n in adapters if n}
        model = _hf_model(used)
        bench_hf(model, tok, prompts[:1], adapters[:1], 4)
        hf = bench_hf(model, tok, prompts, adapters, a.new_tokens)
        goal = GOALS[len(adapters)] * hf
        rows.append(
            {
                "case": case,
                "batch": len(adapters),
                "engine_tok_s": round(ours, 1),
                "hf_tok_s": round(hf, 1),
                "speedup": round(ours / hf, 2),
                "goal_tok_s": round(goal, 1),
                **ceilings(engine.model, len(adapters)),
            }
        )
        r = rows[-1]
        print(
            f"{case:20s} engine {ours:8.1f} tok/s   HF {hf:8.1f} tok/s   x{ours / hf:.2f}   goal {goal:6.1f}   "
            f"ceilings: BLAS matmuls alone {r['blas_ceiling_tok_s']:6.1f}, weight streaming at "
            f"{r['read_GBps']} GB/s {r['stream_ceiling_tok_s']:6.1f}",
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": str(date.today()),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "new_tokens": a.new_tokens,
        "dtype": "float32",
    }
    (a.out / "cpu_generate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, a.out / "cpu_generate.png")


if __name__ == "__main__":
    main()
