"""Rotary position embedding (neox/HF half-rotation layout)."""
import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype):
    """cos, sin: [tokens, head_dim] for positions: [tokens] int64, inv_freq: [head_dim/2]."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x: [tokens, heads, head_dim], cos/sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
