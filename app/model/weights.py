"""Read an HF checkpoint of a supported family (safetensors) into fused per-layer tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from app.model.config import ModelConfig

# Fused projections: one GEMM each; LoRA slices are addressed by column offset.
FUSED = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden], the norm before the MLP
    proj: dict[str, torch.Tensor]  # fused name -> [sum(out), in]
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # fused name -> [sum(out)] (Qwen2's qkv)
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention output (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP output (Gemma)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    final_norm: torch.Tensor
    layers: list[LayerWeights]


def _open_all(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state = {}
    for name in files:
        with safe_open(str(ckpt / name), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def load_weights(ckpt: Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> ModelWeights:
    state = _open_all(Path(ckpt))
    t = cfg.traits

    def get(key: str) -> torch.Tensor:
        return state[key].to(device=device, dtype=dtype)

    def norm(key: str) -> torch.Tensor:
        # Gemma's (1 + w), folded once and kept in fp32: its RMSNorm multiplies in fp32 and rounds once
        return (1.0 + state[key].float()).to(device) if t.norm_plus_one else get(key)

    def proj(p: str, fused: str) -> torch.Tensor:
        block, modules = FUSED[fused]
        if t.fused_checkpoint and len(modules) > 1:  # Phi-3 stores qkv_proj and gate_up_proj as is
            return get(f"{p}{block}.{fused}_proj.weight").contiguous()
        return torch.cat([get(f"{p}{block}.{m}.weight") for m in modules]).contiguous()

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        names = (
            ("input_layernorm", "pre_feedforward_layernorm")
            if t.sandwich_norms
            else ("input_layernorm", "post_attention_layernorm")
        )
        w = LayerWeights(
            norm(p + names[0] + ".weight"), norm(p + names[1] + ".weight"), {fused: proj(p, fused) for fused in FUSED}
        )
        if t.qkv_bias:
            w.bias["qkv"] = torch.cat([get(f"{p}self_attn.{m}.bias") for m in FUSED["qkv"][1]])
        if t.qk_norm:
            w.q_norm, w.k_norm = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
        if t.sandwich_norms:
            w.attn_out_norm = norm(p + "post_attention_layernorm.weight")
            w.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight")
        return w

    embed = get("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed, head, norm("model.norm.weight"), [layer(i) for i in range(cfg.num_layers)])
