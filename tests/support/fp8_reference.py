"""fp8 weights back to floats, as the tests' reference for the format of ops/fp8.py (the engine
never dequantizes: its GEMM scales the fp8 product)."""

import torch


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] e4m3 · s [N] → [N, K] in dtype (computed in fp32)."""
    return (q.float() * s.float()[:, None]).to(dtype)
