"""Read an HF checkpoint of a supported family (safetensors) into fused per-layer tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from app.model.config import ModelConfig
from app.model.quantization import check_device, check_shapes, quantize_projections, read_fp8

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
    proj: dict[str, torch.Tensor]  # fused name -> [sum(out), in] (float8_e4m3fn where `scale` has it)
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # fused name -> [sum(out)] (Qwen2's qkv)
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention output (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP output (Gemma)
    scale: dict[str, torch.Tensor] = field(default_factory=dict)  # fused name -> [sum(out)] fp32 (fp8 proj)


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
    """cfg.quantization: projections made fp8 here, or read as fp8 from the checkpoint."""
    quant = cfg.quantization
    check_device(device, quant, dtype)
    state = _open_all(Path(ckpt))
    t = cfg.traits

    def get(key: str) -> torch.Tensor:
        return state[key].to(device=device, dtype=dtype)

    def norm(key: str) -> torch.Tensor:
        # Gemma's (1 + w), folded once and kept in fp32: its RMSNorm multiplies in fp32 and rounds once
        return (1.0 + state[key].float()).to(device) if t.norm_plus_one else get(key)

    def stored(p: str, fused: str) -> list[str]:
        """The checkpoint modules of one fused projection (Phi-3 stores qkv_proj and gate_up_proj as is)."""
        block, modules = FUSED[fused]
        names = [f"{fused}_proj"] if t.fused_checkpoint and len(modules) > 1 else modules
        return [f"{p}{block}.{m}" for m in names]

    def proj(p: str, fused: str, as_stored: bool = False) -> torch.Tensor:
        """as_stored: in the checkpoint's own precision (what fp8 quantization at load starts from)."""
        read = (lambda k: state[k].to(device)) if as_stored else get  # noqa: E731
        return torch.cat([read(m + ".weight") for m in stored(p, fused)]).contiguous()

    def projections(p: str) -> tuple[dict, dict]:
        """(fused name → weight, fused name → fp8 scale, empty unless quantized)."""
        if quant is not None and quant.checkpoint:
            pairs = {f: [read_fp8(state, m, device) for m in stored(p, f)] for f in FUSED}
            return (
                {f: torch.cat([q for q, _ in ps]).contiguous() for f, ps in pairs.items()},
                {f: torch.cat([s for _, s in ps]) for f, ps in pairs.items()},
            )
        weights = {fused: proj(p, fused, as_stored=quant is not None) for fused in FUSED}
        if quant is None:
            return weights, {}
        check_shapes(weights, device)
        return quantize_projections(weights)

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        names = (
            ("input_layernorm", "pre_feedforward_layernorm")
            if t.sandwich_norms
            else ("input_layernorm", "post_attention_layernorm")
        )
        proj, scale = projections(p)
        w = LayerWeights(norm(p + names[0] + ".weight"), norm(p + names[1] + ".weight"), proj, scale=scale)
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
