"""Train the three example LoRA adapters of the default model (SmolLM2-135M-Instruct).

    python -m examples.train_adapters --out examples/adapters

Everything is synthetic and deterministic (one --seed; the data: examples/adapter_data.py):

  pirate  the base model's own greedy answers to general questions, rewritten
          with a pirate word map and an "Arr!"-style opener.
  shout   the first sentence of the base model's answer, IN UPPERCASE.
  french  short French answers from templates (capitals, colours, sums,
          animals, food, week days, small talk).

Each adapter uses a different target-module subset / rank / scaling so that the
serving engine is exercised on several shapes (see ADAPTERS below). Training is
CPU-only (torch.set_num_threads(--threads, default 1)), a few minutes per adapter. The
script writes <out>/<name>/adapter_config.json + adapter_model.safetensors
(fp32, PEFT's save_pretrained) and <out>/RECIPE.md with timings and greedy
samples (base vs adapter, HF + PEFT, chat template, one prompt at a time).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from app.model.default import DEFAULT_MODEL_NAME, default_model_dir
from examples.adapter_data import (
    GENERAL_QUESTIONS,
    HELDOUT_FRENCH,
    HELDOUT_GENERAL,
    first_sentences,
    french_examples,
    piratify,
    shoutify,
)

END = "<|im_end|>"

# ---------------------------------------------------------------------------
# adapters: shapes, scaling, optimisation
# ---------------------------------------------------------------------------
ADAPTERS = {
    "pirate": dict(
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
        r=4,
        lora_alpha=8,
        use_rslora=False,  # scaling 8/4 = 2
        lr=2e-3,
        steps=45,
        batch=4,
    ),
    "shout": dict(
        target_modules=["q_proj", "v_proj"],
        r=4,
        lora_alpha=16,
        use_rslora=False,  # scaling 16/4 = 4
        lr=4e-3,
        steps=60,
        batch=4,
    ),
    "french": dict(
        target_modules=["o_proj", "down_proj"],
        r=8,
        lora_alpha=16,
        use_rslora=True,  # scaling 16/sqrt(8) ~ 5.66
        lr=2e-3,
        steps=50,
        batch=4,
    ),
}


# ---------------------------------------------------------------------------
# model helpers
# ---------------------------------------------------------------------------
def prompt_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def generate_batched(model, tok, questions, max_new_tokens, batch=16) -> list[str]:
    """Greedy, left-padded batches (used only to build training data)."""
    tok.padding_side = "left"
    outs = []
    for i in range(0, len(questions), batch):
        enc = tok(
            [prompt_text(tok, q) for q in questions[i : i + batch]],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        outs += tok.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return outs


@torch.no_grad()
def generate_one(model, tok, question, max_new_tokens=40) -> str:
    """Greedy, one prompt, no padding: the reference samples in RECIPE.md."""
    enc = tok(prompt_text(tok, question), return_tensors="pt", add_special_tokens=False)
    gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(gen[0, enc.input_ids.shape[1] :], skip_special_tokens=True).strip()


def encode(tok, question: str, answer: str, max_len: int = 128):
    p = tok(prompt_text(tok, question), add_special_tokens=False).input_ids
    a = tok(answer + END, add_special_tokens=False).input_ids
    ids = (p + a)[:max_len]
    labels = ([-100] * len(p) + a)[:max_len]
    return ids, labels


def train_one(model_dir, tok, name, spec, data, seed, log):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=spec["r"],
        lora_alpha=spec["lora_alpha"],
        use_rslora=spec["use_rslora"],
        target_modules=spec["target_modules"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg)
    model.train()
    inner = model.base_model.model  # LlamaForCausalLM with LoRA layers injected
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0)
    steps, bs, warm = spec["steps"], spec["batch"], 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    encoded = [encode(tok, q, a) for q, a in data]
    rng = random.Random(seed)
    order: list[int] = []
    t0 = time.time()
    n_tok = 0
    for step in range(steps):
        if len(order) < bs:
            perm = list(range(len(encoded)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[:bs], order[bs:]
        T = max(len(encoded[i][0]) for i in idx)
        ids = torch.full((bs, T), tok.pad_token_id, dtype=torch.long)
        lab = torch.full((bs, T), -100, dtype=torch.long)
        att = torch.zeros((bs, T), dtype=torch.long)
        for j, i in enumerate(idx):
            x, y = encoded[i]
            ids[j, : len(x)] = torch.tensor(x)
            lab[j, : len(y)] = torch.tensor(y)
            att[j, : len(x)] = 1
        n_tok += int(att.sum())
        # logits only where there is a label (answer tokens): skips most of the 49k-vocab head
        h = inner.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1]
        tgt = lab[:, 1:]
        keep = tgt != -100
        loss = F.cross_entropy(inner.lm_head(h[keep]), tgt[keep])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            log(f"  [{name}] step {step + 1:3d}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    secs = time.time() - t0
    model.eval()
    return model, secs, n_tok


def save_adapter(model, out_dir: Path):
    model.peft_config["default"].base_model_name_or_path = DEFAULT_MODEL_NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    readme = out_dir / "README.md"
    if readme.exists():
        readme.unlink()


# ---------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="examples/adapters")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1 is faster than 2 on a busy 2-core box (OpenMP barriers stall under contention)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="train only these adapters")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every step count")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    names = args.only or list(ADAPTERS)

    # ---- synthetic data --------------------------------------------------
    t0 = time.time()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data: dict[str, list[tuple[str, str]]] = {}
    if {"pirate", "shout"} & set(names):
        raw = generate_batched(base, tok, GENERAL_QUESTIONS, max_new_tokens=32, batch=len(GENERAL_QUESTIONS))
        data["pirate"] = [(q, piratify(first_sentences(a, 2, 22), rng)) for q, a in zip(GENERAL_QUESTIONS, raw)]
        data["shout"] = [(q, shoutify(a)) for q, a in zip(GENERAL_QUESTIONS, raw)]
    data["french"] = french_examples(rng)
    gen_secs = time.time() - t0
    log(
        f"synthetic data: {', '.join(f'{k}={len(v)}' for k, v in data.items())} examples "
        f"({gen_secs:.0f}s, base-model answers included)"
    )
    (out / "_data_preview.json").write_text(
        json.dumps({k: v[:5] for k, v in data.items()}, indent=1, ensure_ascii=False)
    )

    heldout = {"pirate": HELDOUT_GENERAL, "shout": HELDOUT_GENERAL, "french": HELDOUT_FRENCH}
    base_samples = {q: generate_one(base, tok, q) for q in dict.fromkeys(sum(heldout.values(), []))}
    del base

    # ---- training --------------------------------------------------------
    results = {}
    for name in names:
        spec = dict(ADAPTERS[name])
        spec["steps"] = max(1, round(spec["steps"] * args.steps_scale))
        model, secs, n_tok = train_one(model_dir, tok, name, spec, data[name], args.seed, log)
        save_adapter(model, out / name)
        samples = {q: generate_one(model, tok, q) for q in heldout[name]}
        size = (out / name / "adapter_model.safetensors").stat().st_size
        results[name] = dict(
            spec=spec,
            secs=secs,
            n_tok=n_tok,
            samples=samples,
            size=size,
            n_examples=len(data[name]),
            example=data[name][0],
        )
        log(f"{name}: {secs:.0f}s train, {size / 1e6:.2f} MB")
        for q, a in samples.items():
            log(f"    Q: {q}\n    A: {a}")
        del model
    (out / "_data_preview.json").unlink()
    write_recipe(out, results, base_samples, gen_secs, args)


def write_recipe(out: Path, results, base_samples, gen_secs, args):
    total = sum(r["secs"] for r in results.values())
    L = [
        "# Example adapters — recipe",
        "",
        f"Base model: `{DEFAULT_MODEL_NAME}` (the project's default checkpoint, "
        "`app.model.default.default_model_dir()`). Regenerate with",
        "",
        "    python -m examples.train_adapters --out examples/adapters",
        "",
        f"(seed {args.seed}, `torch.set_num_threads({args.threads})`, CPU, fp32, PEFT "
        "`save_pretrained` → `adapter_config.json` + `adapter_model.safetensors`, fp32 weights).",
        "",
        "## Data (synthetic, generated by the script)",
        "",
        f"- **pirate** — the base model's own greedy answers (max 32 new tokens) to "
        f"{len(GENERAL_QUESTIONS)} general questions, whole sentences up to 22 words (at most 2; a longer first sentence is cut at a comma), rewritten with a pirate word map "
        "(you→ye, is/are→be, the→th', my→me, -ing→-in', friend→matey, …) plus an opener "
        '("Arr!", "Ahoy, matey!", …).',
        '- **shout** — the same base answers, first sentence only (≤12 words), UPPERCASED, ending in "!".',
        '- **french** — short French answers from templates: capitals, "where is <city>", colours, '
        'animal facts and legs, "do you like <food>", week days, sums of two digits, small talk.',
        "",
        "Loss on answer tokens only (prompt labels = -100); the answer ends with `<|im_end|>`. "
        "Prompts use the tokenizer's chat template (default system prompt). Held-out questions below "
        "are not in the training data.",
        "",
        "## Hyper-parameters and cost",
        "",
        "| adapter | target modules | r | alpha | rsLoRA | scaling | steps × batch | lr | examples | train time | safetensors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r["spec"]
        scaling = s["lora_alpha"] / (math.sqrt(s["r"]) if s["use_rslora"] else s["r"])
        L.append(
            f"| `{name}` | {', '.join(s['target_modules'])} | {s['r']} | {s['lora_alpha']} | "
            f"{'yes' if s['use_rslora'] else 'no'} | {scaling:.3f} | {s['steps']} × {s['batch']} | "
            f"{s['lr']:g} | {r['n_examples']} | {r['secs']:.0f} s | {r['size'] / 1e6:.2f} MB |"
        )
    L += [
        "",
        f"AdamW (no weight decay), 5-step warm-up then cosine to 10 %, grad-clip 1.0, LoRA dropout 0, "
        f"seq ≤ 128. Measured on a 2-core CPU (shared): training {total:.0f} s in all, plus "
        f"{gen_secs:.0f} s to generate the synthetic data.",
        "",
        "## Samples (greedy, chat template, HF + PEFT, max 40 new tokens)",
        "",
    ]
    for name, r in results.items():
        L += [f"### `{name}`", "", f"Training example: *{r['example'][0]}* → `{r['example'][1]}`", ""]
        for q, a in r["samples"].items():
            L += [f"**Q:** {q}", "", f"- base: {base_samples[q]!r}", f"- {name}: {a!r}", ""]
    L += [NOTES]
    (out / "RECIPE.md").write_text("\n".join(L))


NOTES = """## Notes

- The adapters change *style*, not knowledge: the base model (dequantized from a Q4_1 GGUF) is often
  factually wrong and the pirate/shout data inherit its answers; the French templates are simple and
  the adapter generalises them loosely (wrong colours, gender slips) — but the language is obvious.
- The French held-out questions are new *fillings* of trained templates (Spain is left out of the
  capital template, the banana of the colour template, elephants of the animal-fact template), not new
  topics; on open questions the adapter answers in loose, often nonsensical French.
- Weights are fp32, keys as PEFT writes them (`base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`,
  A: `[r, in]`, B: `[out, r]`); the scale is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.
- Together the three cover all seven projections (q, k, v, o, gate, up, down), ranks 4 and 8, GQA-shaped
  k/v (out 192), and three scalings (2, 4, 16/sqrt(8)).
- One thread: on a busy 2-core machine two OpenMP threads were 1.5–5x slower per step than one.
  Timings vary with the machine's load; results are deterministic for a given torch build and thread count.
"""


if __name__ == "__main__":
    main()
