"""The base model's shape and per-layer attention settings, read once from an HF config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapters_store.peft_weights import ModelShape
from app.model.family import PHI3_FUSED, Traits, check_supported
from app.model.quantization import Quantization, resolve


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
    family: str = "llama"  # the HF model_type
    traits: Traits = Traits()
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window (keys q-w < k <= q), None: full
    local_inv_freq: torch.Tensor | None = None  # Gemma 3's sliding layers' RoPE (with local_rope_scaling)
    local_rope_scaling: float = 1.0
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    fused_adapter_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # fp8 base projections (app/model/quantization.py); in the prefix cache's model key with the rest
    quantization: Quantization | None = None

    @classmethod
    def from_hf(cls, hf, quantization: str | None = None) -> ModelConfig:
        """quantization: the `quantization` argument ("fp8" or None); a checkpoint's own
        quantization_config is read (and refused unless served) either way."""
        traits = check_supported(hf)
        quant = resolve(hf, quantization)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq, scaling, local_inv, local_scaling = _rope(hf, traits)
        eos = hf.eos_token_id
        pre_attn = getattr(hf, "query_pre_attn_scalar", None)
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
            inv_freq=inv_freq,
            rope_scaling=scaling,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            family=hf.model_type,
            traits=traits,
            attn_scale=None if pre_attn is None else float(pre_attn) ** -0.5,
            layer_windows=_windows(hf, traits),
            local_inv_freq=local_inv,
            local_rope_scaling=local_scaling,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None),
            final_softcap=getattr(hf, "final_logit_softcapping", None),
            fused_adapter_modules=dict(PHI3_FUSED) if traits.fused_checkpoint else {},
            quantization=quant,
        )

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    @property
    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.module_dims, self.fused_adapter_modules)


def _windows(hf, traits: Traits) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return ()
    if traits.all_layers_slide:
        return (int(window),) * hf.num_hidden_layers
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _rope(hf, traits: Traits):
    """(inv_freq, attention scaling) of the full-attention layers, and of the sliding ones where
    they differ (Gemma 3), exactly as the checkpoint's own rotary class computes them."""
    if traits.local_rope:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        rope = Gemma3RotaryEmbedding(hf)
        return (
            rope.full_attention_inv_freq.float(),
            float(rope.full_attention_attention_scaling),
            rope.sliding_attention_inv_freq.float(),
            float(rope.sliding_attention_attention_scaling),
        )
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(hf)
    return rope.inv_freq.float(), float(rope.attention_scaling), None, 1.0
