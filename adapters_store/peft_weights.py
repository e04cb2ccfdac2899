"""PEFT ``adapter_model.safetensors`` → per-(layer, module) LoRA matrices, validated
against the base model's shapes. Pickled ``.bin`` files are never opened."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from adapters_store.errors import InvalidAdapterError
from adapters_store.manifest import TARGET_MODULES, AdapterManifest, read_manifest

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must fit: layer count and (in, out) features per module."""

    num_layers: int
    dims: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ModuleStack:
    """One module's matrices over the layers that have it, in the GPU pool's layout
    (B transposed), so a whole module moves into a pool slot with one copy per matrix."""

    layers: tuple[int, ...]
    A: torch.Tensor  # [len(layers), rank, in]
    Bt: torch.Tensor  # [len(layers), rank, out]


@dataclass(frozen=True)
class LoraWeights:
    """A: [rank, in] and B: [out, rank] per (layer, module), fp32 on the host as parsed.
    Packed (adapters_store.host_cache.pack): ``tensors`` are views into one ``buffer``
    that ``stacks`` also view, module by module."""

    name: str
    version: str
    manifest: AdapterManifest
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    buffer: torch.Tensor | None = None  # [elements], one dtype
    stacks: dict[str, ModuleStack] | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def _group(state: dict[str, torch.Tensor], shape: ModelShape) -> dict:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None:
            raise InvalidAdapterError(f"unexpected tensor {key!r} (only LoRA A/B weights are served)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise InvalidAdapterError(f"unknown target module {module!r} in {key!r}")
        if layer >= shape.num_layers:
            raise InvalidAdapterError(f"{key!r}: layer {layer} but the base model has {shape.num_layers}")
        pairs.setdefault((layer, module), {})[ab] = tensor
    return pairs


def _check_pair(where: tuple[int, str], pair: dict, rank: int, shape: ModelShape):
    if set(pair) != {"A", "B"}:
        raise InvalidAdapterError(f"layer {where[0]} {where[1]}: missing lora_{'A' if 'A' not in pair else 'B'}")
    a, b = pair["A"], pair["B"]
    d_in, d_out = shape.dims[where[1]]
    if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
        raise InvalidAdapterError(
            f"layer {where[0]} {where[1]}: shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit the base "
            f"model (expected A({rank}, {d_in}) B({d_out}, {rank}))"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise InvalidAdapterError(f"layer {where[0]} {where[1]}: weights must be floating point")
    a, b = a.float(), b.float()
    for ab, t in (("A", a), ("B", b)):
        if not bool(torch.isfinite(t).all()):  # would turn every output of the adapter into NaN
            raise InvalidAdapterError(f"layer {where[0]} {where[1]}: lora_{ab} holds NaN or Inf values")
    return a, b


def parse_weights(name: str, manifest: AdapterManifest, blob: bytes, shape: ModelShape) -> LoraWeights:
    try:
        state = load_safetensors(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise InvalidAdapterError(f"{WEIGHTS_FILE} is corrupt: {exc}") from None
    pairs = _group(state, shape)
    if not pairs:
        raise InvalidAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    if manifest.target_modules is not None:
        stray = {m for _, m in pairs} - set(manifest.target_modules)
        if stray:
            raise InvalidAdapterError(f"weights for {sorted(stray)} not listed in target_modules")
    tensors = {where: _check_pair(where, pair, manifest.rank, shape) for where, pair in pairs.items()}
    return LoraWeights(name, hashlib.sha256(blob).hexdigest(), manifest, tensors)


def load_local(name: str, adapter_dir: Path, max_rank: int, shape: ModelShape) -> LoraWeights:
    """Read a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    manifest = read_manifest(adapter_dir, max_rank)
    weights = adapter_dir / WEIGHTS_FILE
    if not weights.is_file():
        has_bin = (adapter_dir / "adapter_model.bin").exists()
        hint = " (pickled adapter_model.bin is never loaded: convert it to safetensors)" if has_bin else ""
        raise InvalidAdapterError(f"missing {WEIGHTS_FILE} in adapter {name!r}{hint}")
    return parse_weights(name, manifest, weights.read_bytes(), shape)
