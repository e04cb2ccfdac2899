"""Normalisation ops."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype.

    x: [tokens, hidden]; weight: [hidden]. Rounds exactly where HF's LlamaRMSNorm does.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
