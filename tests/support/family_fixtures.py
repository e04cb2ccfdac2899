"""Tiny random checkpoints of every supported family, made with HF's own config classes, and the
HF transformers + PEFT greedy reference (eager attention: the exact soft-capped one)."""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
WINDOW = 8  # shorter than the tests' contexts, so the window decides the attention
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "tie_word_embeddings": True})), LLAMA_TARGETS


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=32)), LLAMA_TARGETS  # head_dim != hidden / heads


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=WINDOW)), LLAMA_TARGETS


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        **{**_COMMON, "tie_word_embeddings": True},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=10.0,
    )
    return Gemma2ForCausalLM(cfg), LLAMA_TARGETS


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **{**_COMMON, "tie_word_embeddings": True},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    return Gemma3ForCausalLM(cfg), LLAMA_TARGETS


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**_COMMON, sliding_window=WINDOW)), [
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    ]


FAMILIES = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
}


def make_family_checkpoint(family: str, path: Path, seed: int = 0) -> tuple[Path, list[str]]:
    """A random checkpoint of `family` whose biases and norm weights are random too (HF initialises
    them to 0 / 1, which would hide a dropped bias or a misread norm). Returns (path, LoRA targets)."""
    torch.manual_seed(seed)
    model, targets = FAMILIES[family]()
    randomize_biases_and_norms(model)
    model.save_pretrained(path, safe_serialization=True)
    return path, targets


def randomize_biases_and_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)


def hf_family_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_family_greedy_many(model_dir, adapter_dir, [prompt], max_new_tokens)[0]


def hf_family_greedy_many(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of HF transformers (+ PEFT), fp32, eager attention, one prompt at a time
    (no padding), the model loaded once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs
