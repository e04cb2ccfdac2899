"""Every supported family on CUDA (fp16 and bf16, CUDA graphs on) at a real checkpoint's head
layout with random weights, against HF transformers + PEFT (eager attention) on the same GPU;
and the paged attention's sliding window and soft-capping against an fp32 reference."""

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from ops import paged_attention as pa
from tests.gpu.test_engine_gpu import check_mixed_batch_matches_peft
from tests.gpu.test_paged_attention_gpu import BS, block_tables, paged_cache, prefill_rows, rel_err
from tests.support.family_fixtures import LLAMA_TARGETS, randomize_biases_and_norms
from tests.support.family_precision import errors_from_fp32
from tests.support.helpers import make_random_adapter

pytestmark = pytest.mark.gpu

WINDOW = 32  # shorter than the contexts below, so the window decides the attention
VOCAB = 512
_SMALL = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    intermediate_size=1024,
    max_position_embeddings=1024,
    initializer_range=0.05,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _config(family):
    """HF config of the family with a real checkpoint's heads (named), a few layers, a small vocab."""
    import transformers as T

    return {
        "qwen2": lambda: T.Qwen2Config(
            **_SMALL, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4
        ),  # Qwen2.5-7B
        "qwen3": lambda: T.Qwen3Config(
            **_SMALL, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128
        ),  # Qwen3-0.6B
        "mistral": lambda: T.MistralConfig(
            **_SMALL, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, sliding_window=WINDOW
        ),  # 7B v0.1
        "gemma2": lambda: T.Gemma2Config(
            **_SMALL,
            hidden_size=2304,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=WINDOW,
        ),  # Gemma-2-2B, softcaps 50 / 30
        "gemma3_text": lambda: T.Gemma3TextConfig(
            **{**_SMALL, "num_hidden_layers": 3},
            hidden_size=640,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),  # 270M
        "phi3": lambda: T.Phi3Config(
            **_SMALL, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, sliding_window=WINDOW
        ),  # mini
    }[family]()


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"])
def family_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    randomize_biases_and_norms(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if request.param == "phi3" else LLAMA_TARGETS
    adapters = {
        f"r{r}": make_random_adapter(path, path / "adapters" / f"r{r}", rank=r, targets=targets, seed=r)
        for r in (8, 16)
    }
    return request.param, path, adapters


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_family_on_gpu_matches_peft(family_model, dtype):
    """As tests/gpu/test_engine_gpu.py: each generated token is HF+PEFT's greedy choice given the
    same prefix (HF with eager attention: the soft-capped one), except at a near-tie within HF's
    own fp16/bf16 error. Prompts up to 3 windows long. No count of requests exact end to end is
    required: at these head layouts HF's own half-precision argmax differs from its fp32 argmax at
    2-24 % of positions, and the same runs on the CPU diverge at the same tokens (docs/models.md);
    the tie-free bar is test_family_on_gpu_as_close_to_fp32_as_hf below."""
    name, path, adapters = family_model
    engine = build_engine(
        path,
        EngineConfig(max_lora_rank=16, max_loras=2, num_kv_blocks=256, dtype=dtype, device="cuda"),
        {k: str(v) for k, v in adapters.items()},
        tokenizer=None,
    )
    print(name)
    check_mixed_batch_matches_peft(
        engine,
        path,
        adapters,
        dtype,
        VOCAB,
        names=[None, "r8", "r16", None, "r8", "r16"],
        max_prompt=3 * WINDOW,
        attn_implementation="eager",
        min_exact=0,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_family_on_gpu_as_close_to_fp32_as_hf(family_model, dtype):
    """Teacher-forced over 3 windows, half in a prefill step, then one decode step per token (CUDA
    graphs where the runner has them; the fused RoPE/KV and norm kernels, the SGMV add-on of split
    fused adapters): the engine's logits lie no farther from HF's fp32 logits
    than HF's own fp16/bf16 logits do (within 25 %), base and both adapters. Unlike greedy token
    equality, this has no near-ties: at these head layouts HF's own bf16 argmax differs from its
    fp32 argmax at 5-15 % of positions (measured on CPU for qwen2, mistral, phi3)."""
    import random

    name, path, adapters = family_model
    engine = build_engine(
        path,
        EngineConfig(max_lora_rank=16, max_loras=2, num_kv_blocks=256, dtype=dtype, device="cuda"),
        {k: str(v) for k, v in adapters.items()},
        tokenizer=None,
    )
    rng = random.Random(7)
    tokens = [rng.randrange(VOCAB) for _ in range(3 * WINDOW)]
    for adapter in (None, "r8", "r16"):
        (ours, hf), (agree_ours, agree_hf) = errors_from_fp32(engine, path, adapters, tokens, adapter, dtype, "cuda")
        print(
            name,
            dtype,
            adapter,
            f"mean max|logit - fp32|: ours {ours:.4f} HF {hf:.4f}; "
            f"argmax = fp32's: ours {agree_ours:.3f} HF {agree_hf:.3f}",
        )
        assert ours <= 1.25 * hf, (name, adapter, ours, hf)


def _ref(q, k, v, visible, scale, softcap):
    """fp32 attention of q [t, heads, D] over k, v [n, kv_heads, D] where visible [t, n], soft-capped."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(heads // kv_heads, 1)
    vv = v.float().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("thd,nhd->htn", q.float(), kk) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("htn,nhd->thd", torch.softmax(s.masked_fill(~visible[None], float("-inf")), -1), vv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("group, d", [(7, 128), (4, 128), (2, 64)])
@pytest.mark.parametrize("window, softcap", [(100, None), (None, 2.0), (64, 1.5)])  # scores ~N(0, 3): caps bite
def test_paged_decode_window_and_softcap(dtype, group, d, window, softcap):
    gen = torch.Generator(device="cuda").manual_seed(group * d)
    kv_heads = 4
    heads = kv_heads * group
    lens = [1, 50, 99, 100, 101, 700, 2048, 0]
    blocks = sum(-(-n // BS) for n in lens) + 5
    k, v = paged_cache(blocks, kv_heads, d, dtype, gen)
    tables = block_tables([max(n, 1) for n in lens], blocks, gen)
    q = torch.randn(len(lens), heads, d, device="cuda", generator=gen).to(dtype) * 3
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode(
            out, q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), d**-0.5, splits, window, softcap
        )
        for i, n in enumerate(lens):
            if n == 0:
                assert out[i].abs().max() == 0
                continue
            idx = torch.arange(n, device="cuda")
            slots = tables[i, idx // BS].long() * BS + idx % BS
            visible = (idx > n - 1 - window) if window else torch.ones(n, dtype=torch.bool, device="cuda")
            ref = _ref(
                q[i : i + 1],
                k.view(-1, kv_heads, d)[slots],
                v.view(-1, kv_heads, d)[slots],
                visible[None],
                d**-0.5,
                softcap,
            )
            assert rel_err(out[i : i + 1], ref) < (5e-3 if dtype == torch.float16 else 2e-2), (splits, i)


@pytest.mark.parametrize("window, softcap", [(40, None), (None, 2.0), (40, 1.5)])
def test_prefill_window_and_softcap(window, softcap):
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, d, dtype = 8, 2, 128, torch.bfloat16
    reqs = [(0, 90), (70, 30), (0, 3)]  # (tokens already cached, new tokens)
    q, k, v, rows, cu_q, kv_index = prefill_rows(reqs, heads, kv_heads, d, dtype, gen)
    q = q * 3
    out = torch.full_like(q, float("nan"))
    pa.prefill_varlen(out, q, k, v, rows, d**-0.5, window, softcap)
    for i, (a, n) in enumerate(reqs):
        pos_q = a + torch.arange(n, device="cuda")[:, None]
        pos_k = torch.arange(a + n, device="cuda")[None, :]
        visible = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window else True)
        ref = _ref(
            q[cu_q[i] : cu_q[i + 1]],
            k.view(-1, kv_heads, d)[kv_index[i]],
            v.view(-1, kv_heads, d)[kv_index[i]],
            visible,
            d**-0.5,
            softcap,
        )
        assert rel_err(out[cu_q[i] : cu_q[i + 1]], ref) < 2e-2, i
