"""Which reduction order each op of a forward step uses: the library's (fastest, chosen per call
shape, so a row's rounding depends on the other rows of its step) or a fixed one (a row's result
is a function of that row and its context only: the same alone, in any batch, as a prefill row or a
decode row, on any replica).

`Paths` names the choice per op; `fixed(device)` and `LIBRARY` are the two sets the engine picks
between (app/engine/determinism.py: a pure function of its config). The engine enters `using(paths)`
around every forward and graph capture; the ops read `current()` (a context variable: another
engine's thread in the same process keeps its own).

Fixed orders, per op (each one's module says how):
- gemm `row_tiles`: x @ W.T in calls of exactly GEMM_TILE_ROWS rows (zero-padded), so the library
  sees one shape whatever M is (ops/fixed_gemm.py).
- attention `per_row`: every query row, prefill or decode, reduces over its own context alone in
  a fixed order (CUDA: the decode kernel, one split; elsewhere chunked torch: ops/fixed_attention.py).
- lora `fixed_split`: SGMV at one kernel shape whatever the batch (CUDA sm_90: ops/lora.py
  FIXED_SGMV), the add-on's two products as fixed-tile GEMMs elsewhere.
- sampler `per_row`: already a function of the row's logits and seed (ops/sampling.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Paths:
    gemm: str  # "library" | "row_tiles"
    attention: str  # "library" (split counts by batch shape) | "per_row"
    lora: str  # "library" (cluster width / rank groups by grid) | "fixed_split"
    sampler: str = "per_row"
    gemm_tile_rows: int = 0  # rows per GEMM call on row_tiles (0: the library's)

    @property
    def deterministic(self) -> bool:
        return (self.gemm, self.attention, self.lora) == ("row_tiles", "per_row", "fixed_split")

    def as_dict(self) -> dict:
        return asdict(self)


LIBRARY = Paths(gemm="library", attention="library", lora="library")

# Rows per GEMM call: on CUDA 128 (a decode batch up to 128 costs one weight read, as cuBLAS's own
# does; a 2,048-token prefill reads the weights 16 times instead of once: the cost is not measured
# yet, benchmarks/determinism.py); on the CPU 16 (MKL's small-M kernels; a decode row pads to 16).
GEMM_TILE_ROWS = {"cuda": 128, "cpu": 16}


def fixed(device: str | torch.device) -> Paths:
    kind = torch.device(device).type
    return Paths(gemm="row_tiles", attention="per_row", lora="fixed_split", gemm_tile_rows=GEMM_TILE_ROWS[kind])


_current: contextvars.ContextVar[Paths] = contextvars.ContextVar("loraplex_paths", default=LIBRARY)


def current() -> Paths:
    return _current.get()


@contextlib.contextmanager
def using(paths: Paths):
    """Ops called inside this block (on this thread) take `paths`. On row_tiles, cuBLAS also reduces
    in fp32 inside the block (its reduced-precision split-K rounds partial sums to fp16/bf16 at a
    split of its choosing); the flags are torch's process-wide ones, restored on leaving."""
    token = _current.set(paths)
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    if paths.gemm == "row_tiles":
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        _current.reset(token)
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


def pin_cuda_workspace() -> None:
    """A fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, read when the process's first cuBLAS handle
    is made: effective only if set before any GEMM ran; a value already set is kept)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
