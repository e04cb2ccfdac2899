"""y = x @ W.T (+ bias) for the base projections and the LM head, in the order `ops.fixed_order`
selects: the library's call (cuBLAS / MKL pick tiling and split-K from M, so a row's rounding
depends on how many rows share the call), or `row_tiles`.

row_tiles: x is copied into a zero-padded buffer of a multiple of T rows (T = Paths.gemm_tile_rows)
and multiplied T rows per call. Every call has the same shape [T, K] x [K, N] and its operands the
same alignment (a fresh buffer, tiles T * K elements apart; W as loaded), so the library picks the
same kernel each time and row i of y depends on row i of x and W alone: bitwise the same for any M,
any position of the row, any batch around it. The price is one weight read per tile instead of one
per call; a kernel with a fixed tiling of its own (a Triton matmul, as vLLM's batch-invariant mode
has) would not pay it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fixed_order import current


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) → [M, N] in x's dtype, in the current path's order."""
    paths = current()
    if paths.gemm != "row_tiles":
        return F.linear(x, w, bias)
    return tiled_linear(x, w, bias, paths.gemm_tile_rows)


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """F.linear in calls of exactly `tile` rows (see the module docstring)."""
    m = x.shape[0]
    tiles = max(1, -(-m // tile))
    padded = torch.zeros(tiles * tile, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:m] = x
    out = torch.empty(tiles * tile, w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(tiles):
        rows = slice(i * tile, (i + 1) * tile)
        out[rows] = F.linear(padded[rows], w, bias)
    return out[:m]
