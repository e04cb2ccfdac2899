"""Read an HF Llama-family checkpoint (safetensors) into fused per-layer tensors."""
from __future__ import annotations

import json
from dataclasses import dataclass
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
    post_norm: torch.Tensor  # [hidden]
    proj: dict[str, torch.Tensor]  # fused name -> [sum(out), in]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    final_norm: torch.Tensor
    layers: list[LayerWeights]


def _open_all(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(str(ckpt / name), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def load_weights(ckpt: Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> ModelWeights:
    state = _open_all(Path(ckpt))
    get = lambda key: state[key].to(device=device, dtype=dtype)  # noqa: E731

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        proj = {
            fused: torch.cat([get(f"{p}{block}.{m}.weight") for m in modules]).contiguous()
            for fused, (block, modules) in FUSED.items()
        }
        return LayerWeights(get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"), proj)

    embed = get("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed, head, get("model.norm.weight"), [layer(i) for i in range(cfg.num_layers)])
