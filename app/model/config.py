"""The base model's shape, read once from an HF config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters_store.peft_weights import ModelShape


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    inv_freq: torch.Tensor  # [head_dim / 2], as the checkpoint's RoPE config defines it
    rope_scaling: float  # attention factor applied to cos/sin (1.0 unless yarn-like)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if getattr(hf, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported architecture {hf.model_type!r}: a Llama-family model is needed")
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
            raise ValueError("projection biases are not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # RoPE exactly as the checkpoint configures it (default, llama3, linear, yarn, ...).
        rope = LlamaRotaryEmbedding(hf)
        eos = hf.eos_token_id
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            max_position_embeddings=hf.max_position_embeddings,
            inv_freq=rope.inv_freq.float(),
            rope_scaling=float(rope.attention_scaling),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @property
    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.module_dims)
