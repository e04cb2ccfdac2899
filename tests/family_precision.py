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

from app.engine.batch import build_paged_step, build_step
from app.engine.sequence import Sequence
from app.protocol import GenerateRequest, SamplingParams


def engine_logits(engine, tokens: list[int], adapter: str | None = None) -> torch.Tensor:
    """The engine's logits [len(tokens), vocab] (fp32) at every position of ``tokens``, computed
    as one prefill through the runner's own step builder (the paged one where the runner uses it).
    The engine must be idle: the sequence takes the KV cache's first blocks."""
    runner, bs = engine.runner, engine.config.block_size
    model, pool = runner.model, runner.model.lora_pool
    request = GenerateRequest("precision", tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), adapter)
    seq = Sequence(request, 0, 0, engine.adapters.get(adapter) if adapter else None)
    seq.block_table = list(range(-(-len(tokens) // bs)))
    if seq.adapter is not None:
        seq.lora_slot = pool.acquire(seq.adapter)
        while not pool.ready(seq.lora_slot):
            pass
    try:
        if runner.paged:
            inputs, _ = build_paged_step([(seq, len(tokens))], pool, bs, engine.config.device, model.cfg.num_kv_heads)
        else:
            inputs, _ = build_step([(seq, len(tokens))], pool, bs, engine.config.device)
        inputs = dataclasses.replace(inputs, sample_rows=torch.arange(len(tokens), device=inputs.token_ids.device))
        return model.forward(inputs, runner.kv).float()
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
    err = lambda x: float((x - ref).abs().amax(-1).mean())  # noqa: E731
    agree = lambda x: float((x.argmax(-1) == ref.argmax(-1)).float().mean())  # noqa: E731
    return (err(ours), err(hf)), (agree(ours), agree(hf))
