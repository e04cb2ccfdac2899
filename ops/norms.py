"""Normalisation ops (CUDA fp16/bf16: one fused kernel, `ops.small_ops`)."""

import torch

from . import small_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype.

    x: [tokens, hidden]; weight: [hidden]. Rounds exactly where HF's LlamaRMSNorm does; an fp32
    weight on a narrower x rounds once at the end instead, as Gemma's RMSNorm does.
    """
    gemma = weight.dtype == torch.float32 and x.dtype != torch.float32
    if small_ops.norm_usable(x) and not gemma:
        return small_ops.rms_norm(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype) if gemma else weight * h.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, rounded to h's dtype), then rms_norm(h): the residual add and the
    next norm in one pass. h, delta: [tokens, hidden]; returns a new [tokens, hidden]."""
    if small_ops.norm_usable(h) and weight.dtype == h.dtype:
        return small_ops.rms_norm(h, weight, eps, delta)
    h.add_(delta)
    return rms_norm(h, weight, eps)
