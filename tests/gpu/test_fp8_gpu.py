"""Device: the fp8 projection (ops/fp8.py: the activation kernel, then torch._scaled_mm with
row-wise scales) against its dequantized fp32 reference, and the engine serving fp8 weights
with adapters under CUDA graphs. Needs sm_89+ (fp8 tensor cores)."""

import pytest
import torch

from ops.fp8 import FP8, _quantize_rows_torch, fp8_linear, quantize, quantize_rows
from tests.support.fp8_reference import dequantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA device with fp8 tensor cores (sm_89+)",
    ),
]

DTYPES = (torch.bfloat16, torch.float16)
# (tokens, out, in): decode and prefill row counts at Llama-2-7B / Llama-3-8B projection shapes
SHAPES = [(1, 12288, 4096), (7, 6144, 4096), (32, 4096, 4096), (64, 28672, 4096), (64, 4096, 14336), (300, 256, 64)]


def _x(rows, cols, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    x[0] *= 50.0  # an outlier token: per-token scales keep the others' resolution
    if rows > 2:
        x[2] = 0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 16), (5, 4096), (64, 14336), (257, 64)])
def test_the_activation_kernel_equals_the_torch_form_bit_for_bit(dtype, rows, cols):
    x = _x(rows, cols, dtype, seed=rows)
    wide = torch.zeros(rows, cols + 64, device="cuda", dtype=dtype)
    wide[:, :cols] = x
    for inp in (x, wide[:, :cols]):  # contiguous, and rows wider apart than cols
        q, s = quantize_rows(inp)
        q_ref, s_ref = _quantize_rows_torch(inp)
        assert q.dtype == FP8 and s.shape == (rows, 1)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n,k", SHAPES)
def test_the_fp8_projection_equals_its_dequantized_fp32_reference(dtype, tokens, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    x = _x(tokens, k, dtype, seed=tokens)
    q, s = quantize(w)
    y = fp8_linear(x, q, s)
    assert y.dtype == dtype and y.shape == (tokens, n)
    assert torch.equal(fp8_linear(x, q, s, bias), y + bias)  # the bias: one add in the output dtype
    qx, sx = quantize_rows(x)
    ref = dequantize(qx, sx[:, 0]).double() @ dequantize(q, s).double().T  # the formula, exactly
    out = y.double()
    # fp32 accumulation, then one rounding to the output dtype: within one of its ulps (plus the
    # accumulation's own error, relative to the row's largest term sum)
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # half the spacing: round to nearest
    terms = dequantize(qx, sx[:, 0]).abs().double() @ dequantize(q, s).abs().double().T
    assert ((out - ref).abs() <= 2 * ulp * ref.abs() + 1e-5 * terms).all()
    # and fp8's own error against the unquantized product: e4m3's 3 mantissa bits on both operands
    exact = x.double() @ w.double().T
    assert (out - exact).norm() / exact.norm() < 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small Llama the paged kernels and graphs serve (head_dim 64), weights at a real model's range
    (std 0.02; an adapter of scale 0.25: a random model amplifies any rounding through its layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.02,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    path = tmp_path_factory.mktemp("fp8-llama")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def test_the_engine_serves_fp8_with_adapters_under_cuda_graphs(model_dir, tmp_path):
    """bf16 on the GPU: the fp8 engine's teacher-forced logits (decode steps replay CUDA graphs)
    match its eager steps', and lie close to the bf16 engine's, base and with an adapter."""
    from adapters_store.manifest import TARGET_MODULES
    from app.engine.config import EngineConfig
    from app.engine.factory import build_engine
    from tests.support.family_precision import engine_logits
    from tests.support.helpers import make_random_adapter

    adapter = {
        "a": str(make_random_adapter(model_dir, tmp_path / "a", rank=8, targets=TARGET_MODULES, alpha=2, seed=3))
    }
    tokens = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))]
    out = {}
    for quant, graphs in ((None, True), ("fp8", True), ("fp8", False)):
        config = EngineConfig(
            quantization=quant, dtype=torch.bfloat16, device="cuda", cuda_graphs=graphs, num_kv_blocks=64
        )
        engine = build_engine(model_dir, config, adapter, tokenizer=None)
        assert (engine.runner.graphs is not None) == graphs
        out[quant, graphs] = {a: engine_logits(engine, tokens, a) for a in (None, "a")}
    cos = torch.nn.functional.cosine_similarity
    for a in (None, "a"):
        # a graph pads its rows to the bucket: cuBLAS may pick another kernel for that M
        assert cos(out["fp8", True][a], out["fp8", False][a], dim=-1).min() > 0.9999
        assert cos(out["fp8", True][a], out[None, True][a], dim=-1).min() > 0.99
