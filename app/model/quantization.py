"""fp8 base weights: which projections, the `quantization` argument and a checkpoint's
`quantization_config`, the GPU check, and reading or making the fp8 tensors (format: ops/fp8.py).

Quantized: q|k|v, o, gate|up and down of every layer (fused as app/model/weights.py fuses them),
one fp8 e4m3 tensor and one fp32 scale per output channel each. Kept in the model dtype:
embeddings, norms, lm_head, biases, the LoRA adapters and the KV cache.

Pre-quantized checkpoints: compressed-tensors "float-quantized" (as llm-compressor writes them):
``<module>.weight`` float8_e4m3fn and ``<module>.weight_scale`` ([N, 1] per channel, or one value
per tensor, spread over the module's rows). Their activation settings are not followed: the
engine always quantizes activations per token at run time (a static ``input_scale`` is ignored;
per-token scales fit each row at least as closely as one calibrated scale). Anything else in a
`quantization_config` is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.fp8 import FP8, check_finite, quantize, warm_up

METHODS = ("fp8",)
_SERVED = "compressed-tensors float-quantized fp8 (per-channel or per-tensor weight scales)"


@dataclass(frozen=True)
class Quantization:
    method: str = "fp8"  # e4m3 weights, one scale per output channel
    activations: str = "fp8 per token, dynamic"
    checkpoint: bool = False  # True: the checkpoint holds the fp8 weights and scales; False: made at load


def resolve(hf, requested: str | None) -> Quantization | None:
    """The model's quantization from the `quantization` argument and the checkpoint's config;
    ValueError naming what is not served."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization {requested!r} is not served (supported: {', '.join(METHODS)})")
    qc = getattr(hf, "quantization_config", None)
    if qc is None:
        return None if requested is None else Quantization()
    check_checkpoint_config(qc.to_dict() if hasattr(qc, "to_dict") else dict(qc))
    return Quantization(checkpoint=True)


def check_checkpoint_config(qc: dict) -> None:
    """Refuse, by name, every part of a quantization_config the loader does not implement."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config: quant_method {method!r} is not served (supported: {_SERVED})")
    bad = []
    groups = qc.get("config_groups") or {}
    if not groups:
        bad.append("no config_groups")
    for name, g in groups.items():
        bad += [f"config_groups.{name}.{what}" for what in _group_refusals(g, g.get("format") or qc.get("format"))]
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        bad.append(f"quantization_status {status!r} (weights not stored compressed)")
    if qc.get("kv_cache_scheme"):
        bad.append("kv_cache_scheme (fp8 KV cache: the KV cache stays in the model dtype)")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            bad.append(key)
    if bad:
        raise ValueError(f"quantization_config not served ({_SERVED} only): " + "; ".join(bad))


def _group_refusals(g: dict, fmt) -> list[str]:
    out = [] if fmt == "float-quantized" else [f"format {fmt!r}"]
    w = g.get("weights") or {}
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        out.append(f"weights {w.get('type')!r} {w.get('num_bits')}-bit")
    if w.get("strategy") not in ("channel", "tensor"):
        out.append(f"weights strategy {w.get('strategy')!r} (block / group scales)")
    if w.get("symmetric") is False or w.get("dynamic"):
        out.append("asymmetric or dynamic weights")
    a = g.get("input_activations")
    if a is not None and (a.get("type"), a.get("num_bits")) != ("float", 8):
        out.append(f"input_activations {a.get('type')!r} {a.get('num_bits')}-bit")
    if g.get("output_activations") is not None:
        out.append("output_activations")
    return out


def check_device(device, quantization: Quantization | None, dtype: torch.dtype) -> None:
    """Refuse fp8 on a GPU without fp8 tensor cores (before any weight is read); else load the
    activation kernel now (a first-use compile would stall a step, or a graph capture)."""
    device = torch.device(device)
    if quantization is None or device.type != "cuda":
        return
    why = gpu_refusal(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    if why:
        raise ValueError(why)
    warm_up(dtype, device)


def gpu_refusal(capability: tuple[int, int], name: str) -> str | None:
    """The one-line refusal of fp8 on this GPU, or None: fp8 tensor cores came with sm_89 (Ada,
    Hopper); an A100 (sm_80) has none, and dequantizing to bf16 per step would read more bytes
    than bf16 weights do."""
    major, minor = capability
    if (major, minor) >= (8, 9):
        return None
    return f"quantization fp8 needs fp8 tensor cores (sm_89+, e.g. H100); {name} is sm_{major}{minor}: serve it in bf16"


def quantize_projections(proj: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(fp8 weights, scales) of one layer's fused projections (fused name → [N, K])."""
    pairs = {fused: quantize(w) for fused, w in proj.items()}
    return {f: q for f, (q, _) in pairs.items()}, {f: s for f, (_, s) in pairs.items()}


def read_fp8(tensors: dict[str, torch.Tensor], module: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, s [N] fp32) of one module of a pre-quantized checkpoint (module: its key prefix)."""
    if module + ".weight" not in tensors:
        raise ValueError(f"{module}.weight missing from the checkpoint")
    q = tensors[module + ".weight"]
    return fp8_pair(module, q, channel_scales(module, tensors.get(module + ".weight_scale"), q), device)


def channel_scales(module: str, s: torch.Tensor | None, q: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """A checkpoint's weight_scale as [N] fp32 (rows: N when q is a shard of it), a per-tensor
    scale spread over the rows; refused when missing or misshapen."""
    if s is None or q.dtype != FP8:
        raise ValueError(
            f"{module} is not fp8 in this fp8 checkpoint (its ignore list?): mixed-precision projections are not served"
        )
    s = s.float().reshape(-1)
    n = q.shape[0] if rows is None else rows
    if s.numel() not in (1, n):
        raise ValueError(f"{module}.weight_scale has {s.numel()} values for {n} output channels")
    return s.expand(n).contiguous() if s.numel() == 1 else s.contiguous()


def fp8_pair(module: str, q: torch.Tensor, s: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) checked (no NaN code, scales finite and positive) and on the device."""
    check_finite(q, s, module)
    return q.to(device).contiguous(), s.to(device)


def check_shapes(proj: dict[str, torch.Tensor], device) -> None:
    """torch._scaled_mm wants K and N multiples of 16 (on CUDA; the CPU reference takes any)."""
    if torch.device(device).type != "cuda":
        return
    for fused, w in proj.items():
        if w.shape[0] % 16 or w.shape[1] % 16:
            raise ValueError(f"quantization fp8: {fused} is {tuple(w.shape)}, not a multiple of 16 on both sides")
