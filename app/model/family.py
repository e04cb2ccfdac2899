"""What each supported architecture changes in the one decoder forward (app/model/llama.py).

A family is a declared set of traits; the numbers a trait needs (window, caps, scales) come from
the checkpoint's config (app/model/config.py). Every HF config field that changes the math and
is not implemented here stops the start-up with a message naming it (`refusals`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    qkv_bias: bool = False  # Qwen2: bias on q, k and v (LoRA adds to the biased output, as PEFT)
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    sandwich_norms: bool = False  # Gemma: RMSNorm on the attention and MLP outputs too
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w); folded into w at load time
    gelu_tanh: bool = False  # Gemma: GeGLU with tanh-approximate GELU instead of SwiGLU
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj stored (and adapted) fused
    all_layers_slide: bool = False  # Mistral, Phi-3: `sliding_window` applies to every layer
    local_rope: bool = False  # Gemma 3: sliding layers use their own RoPE base


_GEMMA = dict(sandwich_norms=True, norm_plus_one=True, gelu_tanh=True, embed_scale=True)
FAMILIES = {
    "llama": Traits(),
    "mistral": Traits(all_layers_slide=True),
    "qwen2": Traits(qkv_bias=True),
    "qwen3": Traits(qk_norm=True),
    "gemma2": Traits(**_GEMMA),
    "gemma3_text": Traits(**_GEMMA, qk_norm=True, local_rope=True),
    "phi3": Traits(fused_checkpoint=True, all_layers_slide=True),
}
PHI3_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")  # static inv_freq; dynamic and longrope rescale per length


def family_of(hf) -> Traits:
    model_type = getattr(hf, "model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _rope_types(hf) -> list[str]:
    params = getattr(hf, "rope_parameters", None) or {}
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    return [(p or {}).get("rope_type", "default") for p in per_type]


def refusals(hf, traits: Traits) -> list[str]:
    """Config fields that change the math and that the engine does not implement, by name."""
    g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    act = g("hidden_activation") or g("hidden_act")
    params = g("rope_parameters") or {}
    checks = [
        (
            any(g(n) for n in ("num_local_experts", "num_experts", "n_routed_experts")),
            "mixture of experts (num_local_experts / num_experts)",
        ),
        (g("attention_bias", False), f"attention_bias=true on {hf.model_type} (projection biases it does not have)"),
        (g("mlp_bias", False), "mlp_bias=true"),
        (g("use_bidirectional_attention"), "use_bidirectional_attention=true"),
        (
            (params.get("partial_rotary_factor") or g("partial_rotary_factor") or 1.0) != 1.0,
            "partial_rotary_factor (partial RoPE)",
        ),
        (g("pretraining_tp", 1) not in (None, 1), "pretraining_tp > 1"),
        (act != ("gelu_pytorch_tanh" if traits.gelu_tanh else "silu"), f"hidden activation {act!r}"),
    ]
    out = [what for bad, what in checks if bad]
    out += [
        f"rope_type {t!r} (supported: {', '.join(SUPPORTED_ROPE)})" for t in _rope_types(hf) if t not in SUPPORTED_ROPE
    ]
    return out


def check_supported(hf) -> Traits:
    """The family's traits, or a ValueError naming everything about this config we cannot serve exactly."""
    traits = family_of(hf)
    bad = refusals(hf, traits)
    if bad:
        raise ValueError(f"unsupported model config ({hf.model_type}): " + "; ".join(bad))
    return traits


def check_checkpoint(path: str) -> None:
    """Refuse, before anything starts, a local checkpoint directory whose config the engine
    cannot serve exactly (the replica would fail the same way, later and once per replica)."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        return  # not a local checkpoint (the replica resolves and checks other sources)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"unsupported model config in {Path(path).name}: {str(exc).splitlines()[0]}") from None
    check_supported(hf)
    from app.model.quantization import resolve

    resolve(hf, None)  # a quantization_config the loader does not serve
