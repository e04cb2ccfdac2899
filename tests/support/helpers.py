"""Test fixtures made on the fly: a tiny random Llama with GQA, random PEFT adapters,
and the HF transformers + PEFT reference generation."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from app.protocol import GenerateRequest, Migrate, TokenChunk
from benchmarks.checkpoints import make_random_adapter, write_llama  # noqa: F401  (the tests take it from here)
from benchmarks.gemma3_270m import gemma3_270m_dir  # noqa: F401  (the tests take it from here)


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with GQA and llama3 RoPE scaling (positions past 64 are scaled)."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8)
    return write_llama(path, seed, **shape, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, initializer_range=0.2, rope_parameters=rope)  # fmt: skip


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: Path, adapter_dir: Path | None):
    """Loaded once per test session (PEFT wraps the base model in place: each adapter its own copy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def hf_greedy(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False
) -> list[int]:
    """Greedy tokens from HF transformers (+ PEFT), one model per (checkpoint, adapter)."""
    return hf_greedy_batch(model_dir, adapter_dir, [prompt], max_new_tokens, ignore_eos)[0]


def hf_greedy_batch(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """hf_greedy for several prompts in one HF generate call, left-padded under an attention
    mask (HF's own batched path: one call instead of one per prompt)."""
    model = _hf_model(Path(model_dir), adapter_dir and Path(adapter_dir))
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None if ignore_eos else eos
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    try:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
    finally:
        model.generation_config.eos_token_id = eos
    return [row[width:].tolist() for row in out]  # [B, max_new_tokens] (shorter rows: none, eos off or not reached)


def run_to_completion(engine, requests: dict[int, list[GenerateRequest]], on_migrate=None, max_steps=10_000):
    """Drive EngineCore.step(); requests[k] join before step k. Returns (tokens by id, finish reasons, migrates)."""
    tokens, reasons, migrates = {}, {}, []
    step = 0
    while engine.has_work() or any(k >= step for k in requests):
        for req in requests.get(step, []):
            engine.add(req)
            tokens.setdefault(req.request_id, [])
        for chunk in engine.step():
            if isinstance(chunk, Migrate):
                migrates.append(chunk)
                if on_migrate:
                    on_migrate(chunk)
            elif isinstance(chunk, TokenChunk):
                tokens[chunk.request_id] += chunk.token_ids
                if chunk.finish_reason:
                    reasons[chunk.request_id] = chunk.finish_reason
        step += 1
        assert step < max_steps, "engine did not finish"
    return tokens, reasons, migrates
