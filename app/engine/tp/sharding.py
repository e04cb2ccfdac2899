"""Megatron-style sharding of the base weights and of every LoRA adapter over N ranks.

Rules (``W`` in HF layout [out, in]; LoRA ``A`` [r, in], ``B`` [out, r]):

- q/k/v, gate/up — column-parallel: rank i holds output rows i·out/N … of ``W`` (whole
  heads for q/k/v, so attention stays local) and of ``B``; ``A`` is replicated. The
  shrink ``x A`` is computed whole on every rank, the expand writes only the rank's columns.
- o, down — row-parallel: rank i holds input columns i·in/N … of ``W`` and of ``A``; ``B``
  is replicated. The rank's partial ``y_i = x_i W_i + (x_i A_i) B`` is summed by the
  backbone's own all-reduce, which so also sums the shrink: Σ_i (x_i A_i) B = (x A) B.
- embeddings, norms, lm_head — replicated; only rank 0 computes logits.
- fp8 per-output-channel scales (app/model/quantization.py) follow the weight's output rows:
  cut with them for column-parallel modules, whole on every rank for row-parallel ones. A
  row-parallel weight quantized at load takes its scales from the whole row, so every rank's
  shard holds exactly the fp8 values one GPU would.

Why the row-parallel shrink is folded into the backbone's all-reduce instead of
all-reducing ``v_i = x_i A_i`` before the expand (L layers, hidden h, rank r, fp16, ring
all-reduce moving 2(N−1)/N of the message per GPU):

- bytes: the backbone's all-reduce moves 2·L·h·2 B per token (Llama-2-70B: L=80,
  h=8192 → 2.6 MB/token); a separate shrink all-reduce would add 2·L·r·2 B per token
  (r=16: 5 KB/token, +0.2 %). Bytes do not decide.
- collectives: the separate one doubles the collectives per step, 2·L → 4·L (70B: +160
  launches per step, each paying NCCL's small-message latency, typically ~10 µs over
  NVLink and not yet measured here → ~1.6 ms added to every step, whose decode at TP 2
  reads 70 GB of weights per GPU, ~17.5 ms at 4.0 TB/s).
- folding's price: every rank reads the whole ``B`` of o and down instead of 1/N of it:
  (N−1)/N · 2·L·r·h·2 B per distinct adapter in the batch (70B, r=16, N=2: 21 MB, ~5 µs at
  4 TB/s; 32 distinct adapters ~0.17 ms), less than the added latency. So each shard's LoRA
  add-on stays local (as in Punica): no communication beyond the backbone's own, and the
  SGMV kernels run unchanged on each shard's slices.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from adapters_store.host_cache import pack
from adapters_store.peft_weights import LoraWeights
from app.model.config import ModelConfig
from app.model.family import Traits
from app.model.quantization import channel_scales, check_device, check_shapes, fp8_pair
from app.model.weights import FUSED, LayerWeights, ModelWeights
from ops.fp8 import channel_scale, quantize

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW = ("o_proj", "down_proj")  # input features split


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank computes: 1/world of the heads, KV heads and MLP width."""
    if dataclasses.replace(cfg.traits, all_layers_slide=False) != Traits():  # shards carry no biases or extra norms
        raise ValueError(f"tensor_parallel_size {world} supports the llama and mistral families only, not {cfg.family}")
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {n} {what}")
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def _cut(t: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    size = t.shape[dim] // shard.world
    return t.narrow(dim, shard.rank * size, size)


# -- adapters ---------------------------------------------------------------------------
def shard_lora_pair(module: str, a: torch.Tensor, b: torch.Tensor, shard: Shard):
    """(A [r, in], B [out, r]) → this rank's (A, B) (views): B by output rows for
    column-parallel modules, A by input columns for row-parallel ones."""
    return (a, _cut(b, 0, shard)) if module in COLUMN else (_cut(a, 1, shard), b)


def shard_adapter(weights: LoraWeights, shard: Shard, dtype: torch.dtype) -> LoraWeights:
    """This rank's part of an adapter, packed in its own buffer: only the shard
    crosses to the rank's GPU; the host cache keeps the one full copy."""
    tensors = {key: shard_lora_pair(key[1], a, b, shard) for key, (a, b) in weights.tensors.items()}
    return pack(dataclasses.replace(weights, tensors=tensors, buffer=None, stacks=None), dtype=dtype)


# -- base weights -----------------------------------------------------------------------
def _scale_or_none(get_slice, key: str):
    try:
        return get_slice(key + ".weight_scale")[:]
    except (KeyError, SafetensorError):  # an index without the key, or a file without it
        return None


def _reader(ckpt: Path):
    """key → a lazy safetensors slice, so each rank reads only its part of the checkpoint."""
    index = ckpt / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    handles: dict[str, object] = {}

    def get_slice(key: str):
        name = weight_map[key] if weight_map else "model.safetensors"
        if name not in handles:
            handles[name] = safe_open(str(ckpt / name), framework="pt")
        return handles[name].get_slice(key)

    return get_slice


def load_shard_weights(ckpt: Path, cfg: ModelConfig, shard: Shard, dtype: torch.dtype, device) -> ModelWeights:
    """This rank's fused per-layer weights (cfg: the full model's config; its quantization: fp8
    projections, read from the checkpoint or made here)."""
    quant = cfg.quantization
    check_device(device, quant, dtype)
    get_slice = _reader(Path(ckpt))
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    full = lambda key: to(get_slice(key)[:])  # noqa: E731

    def part(key: str, module: str, cast=to) -> torch.Tensor:
        s = get_slice(key)
        out, inp = s.get_shape()
        if module in COLUMN:
            n = out // shard.world
            return cast(s[shard.rank * n : (shard.rank + 1) * n])
        n = inp // shard.world
        return cast(s[:, shard.rank * n : (shard.rank + 1) * n])

    def fp8_part(key: str, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (q, s) of one module: its rows' scales (column) or the whole row's (row)."""
        if quant.checkpoint:
            rows = get_slice(key + ".weight").get_shape()[0]
            q = part(key + ".weight", module, cast=lambda t: t)
            s = channel_scales(key, _scale_or_none(get_slice, key), q, rows)
            return fp8_pair(key, q, _cut(s, 0, shard) if module in COLUMN else s, device)
        if module in COLUMN:
            return quantize(part(key + ".weight", module, cast=lambda t: t.to(device)))
        whole = get_slice(key + ".weight")[:].to(device)
        return quantize(_cut(whole, 1, shard), scale=channel_scale(whole))

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        norms = full(p + "input_layernorm.weight"), full(p + "post_attention_layernorm.weight")
        if quant is None:
            proj = {
                fused: torch.cat([part(f"{p}{block}.{m}.weight", m) for m in modules]).contiguous()
                for fused, (block, modules) in FUSED.items()
            }
            return LayerWeights(*norms, proj)
        pairs = {f: [fp8_part(f"{p}{block}.{m}", m) for m in ms] for f, (block, ms) in FUSED.items()}
        proj = {f: torch.cat([q for q, _ in ps]).contiguous() for f, ps in pairs.items()}
        check_shapes(proj, device)
        return LayerWeights(*norms, proj, scale={f: torch.cat([s for _, s in ps]) for f, ps in pairs.items()})

    embed = full("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else full("lm_head.weight")
    return ModelWeights(embed, head, full("model.norm.weight"), [layer(i) for i in range(cfg.num_layers)])
