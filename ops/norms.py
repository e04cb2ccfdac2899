"""Normalisation ops (CUDA fp16/bf16: one fused kernel, `ops.small_ops`)."""
import torch

from . import small_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype.

    x: [tokens, hidden]; weight: [hidden]. Rounds exactly where HF's LlamaRMSNorm does.
    """
    if small_ops.norm_usable(x):
        return small_ops.rms_norm(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, rounded to h's dtype), then rms_norm(h): the residual add and the
    next norm in one pass. h, delta: [tokens, hidden]; returns a new [tokens, hidden]."""
    if small_ops.norm_usable(h):
        return small_ops.rms_norm(h, weight, eps, delta)
    h.add_(delta)
    return rms_norm(h, weight, eps)
