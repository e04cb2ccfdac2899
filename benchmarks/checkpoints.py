"""Random checkpoints for benchmarks and tests: a tiny Llama that speaks the embedded model's
tokenizer (real text, stop strings, chat template) and random (non-zero) PEFT LoRA adapters."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_llama(path: Path, seed: int = 0, **fields) -> Path:
    """A random Llama checkpoint of `fields` (LlamaConfig's), no special tokens, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None, **fields)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_chat_llama(path: Path, seed: int = 0) -> Path:
    from app.model.default import default_model_dir

    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    write_llama(path, seed, **shape, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                initializer_range=0.3)  # fmt: skip
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def make_random_adapter(model_dir: Path, out: Path, rank: int, targets, alpha=None, rslora=False, seed=0) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3 / rank**0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out
