"""fp8's accuracy against bf16 (benchmarks/fp8.py runs it; alone: the CPU emulation on the real
checkpoint, below).

- Logits: 64 prompts, bf16 greedy for 64 new tokens; then both models' logits at every generated
  position, teacher-forced on bf16's tokens (one prefill of the whole sequence): per-token cosine
  similarity of fp8's logits to bf16's, and greedy agreement (fp8's argmax = bf16's token). Base
  model and a random rank-16 adapter on all seven projections; for the adapter also the cosine of
  its contribution (adapter logits − base logits) under fp8 to that under bf16.
- Per layer (random weights of a shape): every fused projection's output relative error
  ‖y − x Wᵀ‖ / ‖x Wᵀ‖ against fp64, fp8 and, beside it, bf16's own, x 64 random bf16 tokens.

On the CPU the fp8 GEMM is its fp32 reference (ops/fp8.py: the same per-token activation and
per-channel weight rounding, fp32 accumulation): the same arithmetic as the GPU up to the order of
the fp32 sums (tests/gpu/test_fp8_gpu.py bounds that), so the real checkpoint, which cannot travel
to the device, is measured here:
    python -m benchmarks.fp8_accuracy          # SmolLM2-135M-Instruct → results/fp8_accuracy_cpu.json
"""

import argparse
import dataclasses
import datetime
import json
import pathlib

import torch

TOPICS = ("the moon", "bread", "rivers", "chess", "volcanoes", "bees", "trains", "winter")
TEMPLATES = (
    "Explain {t} to a child in two sentences.",
    "Write a short poem about {t}.",
    "List three facts about {t}.",
    "What is the history of {t}?",
    "Describe {t} to someone who has never seen it.",
    "Why do people like {t}?",
    "Tell a short story that involves {t}.",
    "Give one surprising question about {t} and answer it.",
)


def prompts(tokenizer, n: int, vocab: int) -> list[list[int]]:
    texts = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS][:n]
    if tokenizer is None:  # a random model: random token prompts
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, min(vocab, 1000), (12,), generator=g).tolist() for _ in texts]
    return [tokenizer.encode(t) for t in texts]


def sequence_logits(engine, tokens: list[int], adapter=None) -> torch.Tensor:
    """Logits [len(tokens), vocab] (fp32) at every position: one prefill step of the whole
    sequence through the runner's step builder (the engine must be idle)."""
    from app.engine.batch import build_step
    from app.engine.sequence import Sequence
    from app.protocol import GenerateRequest, SamplingParams

    model, pool, bs = engine.runner.model, engine.runner.model.lora_pool, engine.config.block_size
    seq = Sequence(GenerateRequest("acc", tuple(tokens), SamplingParams(max_tokens=1)), 0, 0, adapter)
    seq.block_table = list(range(-(-len(tokens) // bs)))
    if adapter is not None:
        seq.lora_slot = pool.acquire(adapter)
        while not pool.ready(seq.lora_slot):
            pass
    try:
        inputs, _ = build_step([(seq, len(tokens))], pool, bs, engine.config.device, model.cfg.num_kv_heads)
        n = len(tokens)
        inputs = dataclasses.replace(inputs, sample_rows=torch.arange(n, device=inputs.token_ids.device))
        return model.forward(inputs, engine.runner.kv).float()
    finally:
        if adapter is not None:
            pool.release((adapter.name, adapter.version))


def greedy(engine, prompt_ids: list[list[int]], new: int, adapter=None) -> list[list[int]]:
    from app.protocol import GenerateRequest, SamplingParams

    for i, p in enumerate(prompt_ids):
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        engine.add(
            GenerateRequest(f"g{i}", tuple(p), params, None if adapter is None else adapter.name), adapter=adapter
        )
    out = {i: [] for i in range(len(prompt_ids))}
    while engine.has_work():
        for c in engine.step():
            if hasattr(c, "token_ids"):
                out[int(c.request_id[1:])] += list(c.token_ids)
    return [out[i] for i in range(len(prompt_ids))]


def logits_agreement(engines: dict, tok, n_prompts: int, new: int, adapter) -> dict:
    """engines: {"bf16": EngineCore, "fp8": EngineCore} over the same checkpoint."""
    cos = torch.nn.functional.cosine_similarity
    ps = prompts(tok, n_prompts, engines["bf16"].runner.model.cfg.vocab_size)
    result = {}
    for name, a in (("base", None), ("adapter", adapter)):
        conts = greedy(engines["bf16"], ps, new, a)
        cosines, agree, delta_cos = [], [], []
        for p, c in zip(ps, conts):
            seq = p + c
            at = slice(len(p) - 1, len(seq) - 1)  # the logits that chose c
            lb, l8 = (sequence_logits(engines[k], seq, a)[at] for k in ("bf16", "fp8"))
            cosines.append(cos(l8, lb, dim=-1))
            agree.append((l8.argmax(-1) == torch.tensor(c)).float())
            if a is not None:
                db = lb - sequence_logits(engines["bf16"], seq)[at]
                d8 = l8 - sequence_logits(engines["fp8"], seq)[at]
                delta_cos.append(cos(d8, db, dim=-1))
        allc = torch.cat(cosines)
        result[name] = dict(
            cosine_min=allc.min().item(),
            cosine_p01=allc.quantile(0.01).item(),
            cosine_mean=allc.mean().item(),
            greedy_agreement=torch.cat(agree).mean().item(),
            tokens=int(allc.numel()),
        )
        if delta_cos:
            d = torch.cat(delta_cos)
            result[name].update(lora_delta_cosine_min=d.min().item(), lora_delta_cosine_mean=d.mean().item())
        print(f"  logits {name}: {result[name]}", flush=True)
    return result


def layer_errors(weights, tokens: int = 64) -> dict:
    """Per fused projection: max and mean over layers of the output relative error, fp8 and bf16."""
    from app.model.quantization import quantize_projections
    from ops.fp8 import fp8_linear

    g = torch.Generator(device=weights.embed.device).manual_seed(0)
    out: dict = {}
    for layer in weights.layers:
        q, s = quantize_projections(layer.proj)
        for fused, w in layer.proj.items():
            x = torch.randn(tokens, w.shape[1], generator=g, device=w.device).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            rel = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
            e = out.setdefault(fused, {"fp8": [], "bf16": []})
            e["fp8"].append(rel(fp8_linear(x, q[fused], s[fused])))
            e["bf16"].append(rel(x @ w.to(torch.bfloat16).T))
    return {f: {k: {"max": max(v), "mean": sum(v) / len(v)} for k, v in e.items()} for f, e in out.items()}


def engines_for(path, device: str, max_batch: int):
    from app.engine.config import EngineConfig
    from app.engine.factory import build_engine

    config = dict(dtype=torch.bfloat16, device=device, max_num_seqs=max_batch, num_kv_blocks=max_batch * 10 + 16)
    return {
        name: build_engine(path, EngineConfig(quantization=q, **config), tokenizer=None)
        for name, q in (("bf16", None), ("fp8", "fp8"))
    }


def random_adapter(cfg, rank: int = 16):
    """A random rank-16 adapter on all seven projections, adding ~20 % to each projection's output
    (x A has unit-scale entries; B std 0.03, scale 2): an adapter that changes the model."""
    from adapters_store.host_cache import pack
    from adapters_store.manifest import TARGET_MODULES, AdapterManifest
    from adapters_store.peft_weights import LoraWeights

    g = torch.Generator().manual_seed(1)
    tensors = {
        (layer, m): (torch.randn(rank, d_in, generator=g) / d_in**0.5, torch.randn(d_out, rank, generator=g) * 0.03)
        for layer in range(cfg.num_layers)
        for m, (d_in, d_out) in cfg.module_dims.items()
    }
    return pack(
        LoraWeights("acc", "1", AdapterManifest(rank, 2.0 * rank, False, TARGET_MODULES), tensors), torch.bfloat16
    )


def run(path, device: str, n_prompts: int, new: int, tokenizer=None) -> dict:
    engines = engines_for(path, device, n_prompts)
    cfg = engines["bf16"].runner.model.cfg
    return logits_agreement(engines, tokenizer, n_prompts, new, random_adapter(cfg))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "fp8_accuracy_cpu.json"
    )
    args = ap.parse_args()
    from app.engine.factory import load_tokenizer
    from app.model.default import DEFAULT_MODEL_NAME, default_model_dir

    path = default_model_dir()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = dict(
        model=DEFAULT_MODEL_NAME + " (real weights)",
        machine="CPU: fp8 GEMM as its fp32 reference (the GPU's arithmetic)",
        date=datetime.date.today().isoformat(),
        prompts=args.prompts,
        new_tokens=args.new,
        logits=run(path, "cpu", args.prompts, args.new, load_tokenizer(path)),
    )
    args.out.write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
