"""fp8 e4m3 base weights with per-output-channel scales, and their GEMM.

Weight format: W [N, K] (out, in; HF layout) is stored as q [N, K] ``torch.float8_e4m3fn``
(row-major) and s [N] float32, W ≈ q · s[:, None]. `quantize` picks s = max(|W[n]|, 1e-12) / 448
per output channel, so each row's largest weight lands on ±448, e4m3's largest finite value;
q = RNE(clamp(W / s, ±448)): whatever a given scale leaves beyond ±448 saturates there (e4m3fn
has no infinity; the clamp is explicit because a cast's overflow is not the same on every
torch version and device).

GEMM (`fp8_linear`), W8A8 with dynamic per-token activation scales:
    x [M, K] fp16/bf16 → q_x [M, K] e4m3, s_x [M, 1] fp32, per row as above (`quantize_rows`);
    y[m, n] = s_x[m] · s[n] · Σ_k q_x[m, k] q[n, k]   (fp32 accumulation)  (+ bias[n]),  in x's dtype.
On CUDA (sm_89+) this is one NVRTC kernel (kernels/fp8_quant.cu) and ``torch._scaled_mm``
(row-wise scales: scale_a [M, 1], scale_b [1, N], both fp32; the second operand column-major,
i.e. q.t() of the row-major q; K and N multiples of 16). Elsewhere `fp8_linear_reference`
computes the same formula in fp32 (CPU serving and tests).

Why activations are quantized too (W8A8) rather than weights only: Hopper's tensor cores take
fp8 only with both operands fp8, and torch has no mixed bf16 × fp8 GEMM. Weight-only fp8 would
dequantize the weights to bf16 first, reading fp8 and writing then re-reading bf16: more bytes
than plain bf16, at decode where the weights' bytes are the step's cost. Per-token scales
(not one per tensor) keep each row's rounding relative to that row's own range.
"""

from __future__ import annotations

import ctypes

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale, not 0 / 0
_CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def channel_scale(w: torch.Tensor) -> torch.Tensor:
    """s [N] fp32 of w [N, K]: max(|w[n]|, 1e-12) / 448."""
    return w.float().abs().amax(dim=1).clamp_min(MIN_AMAX) / FP8_MAX


def quantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, s [N] fp32) of w [N, K]: s = channel_scale(w), or the given [N] scale
    (values beyond ±448 · s saturate). Non-finite weights are refused."""
    w32 = w.float()
    if not torch.isfinite(w32).all():
        raise ValueError("fp8 quantization: the weight holds NaN or Inf")
    s = channel_scale(w32) if scale is None else scale.float().reshape(-1)
    q = (w32 / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), s.contiguous()


def check_finite(q: torch.Tensor, s: torch.Tensor, name: str) -> None:
    """Refuse a checkpoint's fp8 weight with NaN codes, or a scale not finite and positive."""
    if q.dtype != FP8:
        raise ValueError(f"{name}: fp8 weight stored as {q.dtype}, expected float8_e4m3fn")
    if torch.isnan(q.float()).any():
        raise ValueError(f"{name}: NaN in the fp8 weight")
    if not (torch.isfinite(s) & (s > 0)).all():
        raise ValueError(f"{name}: weight_scale holds NaN, Inf or a value <= 0")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_x [M, K] e4m3 contiguous, s_x [M, 1] fp32) of x [M, K], one scale per row (token)."""
    if x.is_cuda and x.dtype in _CTYPE and x.shape[1] % 8 == 0:
        if not _kernel_layout(x):  # copied: the path (and its rounding) never depends on where x lives
            x = x.clone(memory_format=torch.contiguous_format)
        return _quantize_rows_kernel(x)
    return _quantize_rows_torch(x)


def _kernel_layout(x) -> bool:
    """The kernel reads 16-byte vectors: unit-stride rows, 8-element multiples, aligned."""
    return x.shape[1] % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def _quantize_rows_torch(x):
    x32 = x.float()
    s = x32.abs().amax(dim=1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    return (x32 / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ (q · s).T (+ bias) as the module docstring defines it: x [M, K] fp16/bf16 (any
    dtype on the CPU), q [N, K] e4m3 row-major, s [N] fp32, bias [N] or None → y [M, N] in x's dtype."""
    if not x.is_cuda:
        return fp8_linear_reference(x, q, s, bias)
    qx, sx = quantize_rows(x)
    y = torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=x.dtype)
    # bias added here, not by _scaled_mm: its row-wise path takes a bf16 bias only
    return y if bias is None else y.add_(bias)


def fp8_linear_reference(x, q, s, bias=None) -> torch.Tensor:
    """fp8_linear's formula in fp32 (fp64 for fp64 x): activations quantized per token as on the GPU."""
    acc = torch.promote_types(x.dtype, torch.float32)
    qx, sx = _quantize_rows_torch(x)
    y = (qx.to(acc) @ q.to(acc).t()) * sx.to(acc) * s.to(acc)[None, :]
    if bias is not None:
        y = y.to(x.dtype) + bias
    return y.to(x.dtype)


# -- the activation quantization kernel ------------------------------------------------------
class _QuantRowsArgs(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("x_stride", ctypes.c_longlong),
        ("cols", ctypes.c_int),
    ]


def all_kernel_names() -> list[str]:
    """Every instantiation launched here (sm_89+ only: the e4m3 convert)."""
    return [f"quant_rows_kernel<{c}>" for c in _CTYPE.values()]


def _quantize_rows_kernel(x):
    from . import launch, nvrtc  # not at import: CPU-only processes never load NVRTC

    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        args = _QuantRowsArgs(x.data_ptr(), q.data_ptr(), s.data_ptr(), x.stride(0), cols)
        index = torch.cuda.current_device() if x.device.index is None else x.device.index
        func = nvrtc.load_function("fp8_quant.cu", f"quant_rows_kernel<{_CTYPE[x.dtype]}>", index)
        launch.launch(func, rows, 256, args, x.device)
    return q, s


def warm_up(dtype: torch.dtype, device) -> None:
    """Compile (or read from the disk cache) and load the kernel for dtype now."""
    from . import nvrtc

    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    nvrtc.load_function("fp8_quant.cu", f"quant_rows_kernel<{_CTYPE[dtype]}>", index)
