"""How far the engine's fp16/bf16 logits lie from HF's fp32 logits, beside how far HF's own
fp16/bf16 logits lie from them: teacher-forced along one token sequence, every position.

Greedy token equality with HF at fp16/bf16 is a coin toss wherever the top two logits are closer
than the rounding error of either run (at a real head layout with random weights, HF's own bf16
argmax differs from its fp32 argmax at several percent of positions). This measure has no such
ties: an engine that computes a step in a lower precision than HF, adds a bias in another order
that loses bits, or sees one key too many or too few, lies farther from fp32 than HF does."""

from __future__ import annotations

import dataclasses

import torch

from app.engine.batch import build_step
from app.engine.sequence import Sequence
from app.protocol import GenerateRequest, SamplingParams


def engine_logits(engine, tokens: list[int], adapter: str | None = None) -> torch.Tensor:
    """The engine's logits [len(tokens), vocab] (fp32) at every position of ``tokens``, as served:
    the first half in one prefill step through the runner's step builder, then one decode step per
    token through ``runner.run`` (on CUDA a CUDA graph replay). The engine must be idle: the sequence takes the KV cache's first blocks."""
    runner, bs, n = engine.runner, engine.config.block_size, len(tokens)
    model, pool, prefill = runner.model, runner.model.lora_pool, len(tokens) // 2
    request = GenerateRequest(
        "precision", tuple(tokens[:prefill]), SamplingParams(max_tokens=n, temperature=0.0), adapter
    )
    seq = Sequence(request, 0, 0, engine.adapters.get(adapter) if adapter else None)
    seq.block_table = list(range(-(-n // bs)))
    if seq.adapter is not None:
        seq.lora_slot = pool.acquire(seq.adapter)
        while not pool.ready(seq.lora_slot):
            pass
    try:
        inputs, _ = build_step([(seq, prefill)], pool, bs, engine.config.device, model.cfg.num_kv_heads)
        inputs = dataclasses.replace(inputs, sample_rows=torch.arange(prefill, device=inputs.token_ids.device))
        rows = [model.forward(inputs, runner.kv).float()]
        for token in tokens[prefill:]:
            seq.num_computed = seq.num_tokens
            seq.output_ids.append(token)
            rows.append(runner.run([(seq, 1)])[0].float().clone())  # a graph's logits buffer is reused
        return torch.cat(rows)
    finally:
        if seq.adapter is not None:
            pool.release((seq.adapter.name, seq.adapter.version))


def hf_logits(path, adapter_dir, tokens: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """HF (+ PEFT) logits [len(tokens), vocab] in fp32, eager attention (the exact soft-capped one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).to(dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens], device=device)).logits[0].float()


def errors_from_fp32(engine, path, adapter_dirs: dict, tokens: list[int], adapter: str | None, dtype, device):
    """(engine's, HF's) mean over positions of max |logit - HF fp32 logit|, and (engine's, HF's)
    fraction of positions whose argmax is HF fp32's."""
    adapter_dir = adapter_dirs[adapter] if adapter else None
    ours = engine_logits(engine, tokens, adapter)
    hf = hf_logits(path, adapter_dir, tokens, dtype, device)
    ref = hf_logits(path, adapter_dir, tokens, torch.float32, device)

    def err(x):
        return float((x - ref).abs().amax(-1).mean())

    def agree(x):
        return float((x.argmax(-1) == ref.argmax(-1)).float().mean())

    return (err(ours), err(hf)), (agree(ours), agree(hf))
