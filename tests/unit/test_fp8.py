"""The fp8 weight format (ops/fp8.py) on the CPU: quantize → dequantize against an independent
reference of e4m3 rounding, saturation at ±448, non-finite values refused, and the GEMM's formula."""

import pytest
import torch

from ops.fp8 import FP8, FP8_MAX, check_finite, fp8_linear, fp8_linear_reference, quantize, quantize_rows
from tests.support.fp8_reference import dequantize


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, ascending, from its 256 bit patterns (NaN codes dropped)."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    return torch.unique(v[torch.isfinite(v)])


def _reference_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value, ties to the even code, saturating at ±448 (fp64)."""
    grid = _e4m3_values()
    x = x.double().clamp(-FP8_MAX, FP8_MAX)
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    d_lo, d_hi = x - lo_v, hi_v - x
    # a tie goes to the value whose code is even: its mantissa's last bit is 0
    even_hi = (hi_v.float().to(FP8).view(torch.uint8) & 1) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    return torch.where(pick_hi, hi_v, lo_v)


def _weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g, dtype=torch.float64) * 0.05
    w[3] *= 300.0  # a row of outliers gets its own scale
    w[5] = 0.0  # an all-zero row
    w[7, 0] = 1e-9  # a value far below the row's range: e4m3 subnormals, then 0
    return w.float()


def test_quantize_dequantize_round_trip_matches_the_reference():
    w = _weight()
    q, s = quantize(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (24,)
    amax = w.abs().amax(dim=1)
    assert torch.equal(s, amax.clamp_min(1e-12) / FP8_MAX)  # per output channel
    # each row's largest weight lands on ±448
    nonzero = amax > 0
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((int(nonzero.sum()),), FP8_MAX))
    expected = _reference_round(w / s[:, None])  # the quotient in fp32, as the quantizer forms it
    assert torch.equal(q.double(), expected)
    back = dequantize(q, s)
    assert torch.equal(back[5], torch.zeros(40))
    # the round trip's error is at most half of e4m3's spacing (relative 2^-4) in the normal range
    normal = (w.abs() / s[:, None]) >= 2**-6
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-6
    assert rel.max() > 2**-6  # it is fp8, not a copy


def test_values_beyond_the_scale_saturate_at_448():
    w = torch.tensor([[1.0, -3.0, 0.5, 1000.0], [-1e6, 2.0, 0.0, 1.0]])
    q, _ = quantize(w, scale=torch.tensor([1.0 / 100, 1.0]))  # 1000 · 100 and -1e6 lie far beyond 448
    assert q.float()[0].tolist() == [96.0, -288.0, 48.0, FP8_MAX]  # 100, -300 and 50 (a tie: the even code) rounded
    assert q.float()[1].tolist() == [-FP8_MAX, 2.0, 0.0, 1.0]
    assert not torch.isnan(q.float()).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(bad):
    w = _weight()
    w[2, 2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(w)


def test_a_checkpoint_with_nan_codes_or_bad_scales_is_refused():
    q, s = quantize(_weight())
    check_finite(q, s, "ok")
    nan = q.clone()
    nan.view(torch.uint8)[1, 1] = 0x7F  # e4m3fn's NaN code
    with pytest.raises(ValueError, match=r"layer\.x: NaN in the fp8 weight"):
        check_finite(nan, s, "layer.x")
    for value in (float("inf"), float("nan"), 0.0, -1.0):
        bad = s.clone()
        bad[0] = value
        with pytest.raises(ValueError, match="weight_scale"):
            check_finite(q, bad, "layer.x")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_finite(q.float(), s, "layer.x")


def test_activations_are_quantized_per_token():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[1] *= 1000.0
    qx, sx = quantize_rows(x)
    assert qx.dtype == FP8 and sx.shape == (5, 1)
    assert torch.equal(qx.float().abs().amax(dim=1), torch.full((5,), FP8_MAX))
    assert torch.equal(qx.double(), _reference_round(x.float() / sx))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_computes_its_formula(dtype):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 32, generator=g) * 0.1, torch.randn(6, 32, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    q, s = quantize(w)
    y = fp8_linear(x, q, s, bias)  # CPU: the reference
    assert y.dtype == dtype and y.shape == (6, 48)
    qx, sx = quantize_rows(x)
    exact = (dequantize(qx, sx[:, 0]).double() @ dequantize(q, s).double().T).to(dtype) + bias
    # fp32 accumulation against fp64: equal to fp32's rounding (one bf16 ulp once rounded to bf16)
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(y, exact, **tol)
    assert torch.equal(fp8_linear_reference(x, q, s, bias), y)
    # and it is close to the unquantized product (two 2^-4 roundings at most per term)
    full = x.double() @ w.double().T + bias.double()
    assert (y.double() - full).norm() / full.norm() < 0.05


def test_the_activation_kernel_compiles_for_hopper():
    """NVRTC needs no GPU: the kernel fp8_linear launches on CUDA builds for sm_89 and sm_90."""
    pytest.importorskip("cuda.bindings")
    from ops import fp8, nvrtc

    for arch in (89, 90):
        for name in fp8.all_kernel_names():
            image, symbol = nvrtc.compile_kernel("fp8_quant.cu", name, arch)
            assert image and "quant_rows_kernel" in symbol
