"""Every supported family on CUDA (fp16 and bf16, CUDA graphs on) at a real checkpoint's head
layout with random weights, against HF transformers + PEFT (eager attention) on the same GPU;
and the paged attention's sliding window and soft-capping against an fp32 reference."""
import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from ops import paged_attention as pa
from tests.gpu.test_engine_gpu import _first_disagreement
from tests.gpu.test_paged_attention_gpu import BS, _cache, _rel, _tables
from tests.helpers import make_random_adapter, run_to_completion

pytestmark = pytest.mark.gpu

WINDOW = 32  # shorter than the contexts below, so the window decides the attention
NEW_TOKENS = 24
VOCAB = 512
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, intermediate_size=1024, max_position_embeddings=1024,
              initializer_range=0.05, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _config(family):
    """HF config of the family with a real checkpoint's heads (named), a few layers, a small vocab."""
    import transformers as T

    return {
        "qwen2": lambda: T.Qwen2Config(**_SMALL, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4),  # Qwen2.5-7B
        "qwen3": lambda: T.Qwen3Config(**_SMALL, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128),  # Qwen3-0.6B
        "mistral": lambda: T.MistralConfig(**_SMALL, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, sliding_window=WINDOW),  # 7B v0.1
        "gemma2": lambda: T.Gemma2Config(**_SMALL, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                         query_pre_attn_scalar=256, sliding_window=WINDOW),  # Gemma-2-2B, softcaps 50 / 30
        "gemma3_text": lambda: T.Gemma3TextConfig(**{**_SMALL, "num_hidden_layers": 3}, hidden_size=640, num_attention_heads=4,
                                                  num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW,
                                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),  # 270M
        "phi3": lambda: T.Phi3Config(**_SMALL, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, sliding_window=WINDOW),  # mini
    }[family]()


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"])
def family_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if request.param == "phi3" else LLAMA_TARGETS
    adapters = {f"r{r}": make_random_adapter(path, path / "adapters" / f"r{r}", rank=r, targets=targets, seed=r)
                for r in (8, 16)}
    return request.param, path, adapters


def _hf_logits(path, adapter_dir, tokens, dtype):
    """HF (+ PEFT) logits [len(tokens), vocab] in fp32, teacher-forced, eager attention (soft-capped)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").cuda()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).to(dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens], device="cuda")).logits[0].float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_family_on_gpu_matches_peft(family_model, dtype):
    """As tests/gpu/test_engine_gpu.py: each generated token is HF+PEFT's greedy choice given the
    same prefix, except at a near-tie within HF's own fp16/bf16 error; most requests exact."""
    name, path, adapters = family_model
    engine = build_engine(path, EngineConfig(max_lora_rank=16, max_loras=2, num_kv_blocks=256, dtype=dtype, device="cuda"),
                          {k: str(v) for k, v in adapters.items()}, tokenizer=None)
    rng = random.Random(0)
    jobs = [(f"g{i}", a, [rng.randrange(VOCAB) for _ in range(rng.randint(4, 3 * WINDOW))])
            for i, a in enumerate([None, "r8", "r16", None, "r8", "r16"])]
    requests = {}
    for i, (rid, a, p) in enumerate(jobs):
        req = GenerateRequest(rid, tuple(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), a)
        requests.setdefault(i % 3, []).append(req)
    tokens, _, _ = run_to_completion(engine, requests)
    exact, report = 0, []
    for rid, a, p in jobs:
        adapter = adapters[a] if a else None
        seq = p + tokens[rid]
        t, within = _first_disagreement(p, tokens[rid], _hf_logits(path, adapter, seq, dtype),
                                        _hf_logits(path, adapter, seq, torch.float32))
        exact += t is None
        report.append((rid, a, t, within))
    print(name, dtype, "graphs" if engine.runner.graphs else "eager", report)
    assert all(within for *_, within in report), (name, report)
    assert exact >= len(jobs) * (3 if dtype == torch.float16 else 2) // 4, (name, report)


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
@pytest.mark.parametrize("window, softcap", [(100, None), (None, 30.0), (64, 20.0)])
def test_paged_decode_window_and_softcap(dtype, group, d, window, softcap):
    gen = torch.Generator(device="cuda").manual_seed(group * d)
    kv_heads = 4
    heads = kv_heads * group
    lens = [1, 50, 99, 100, 101, 700, 2048, 0]
    blocks = sum(-(-n // BS) for n in lens) + 5
    k, v = _cache(blocks, kv_heads, d, dtype, gen)
    tables = _tables([max(n, 1) for n in lens], blocks, gen)
    q = torch.randn(len(lens), heads, d, device="cuda", generator=gen).to(dtype) * 3
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode(out, q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), d**-0.5, splits,
                        window, softcap)
        for i, n in enumerate(lens):
            if n == 0:
                assert out[i].abs().max() == 0
                continue
            idx = torch.arange(n, device="cuda")
            slots = tables[i, idx // BS].long() * BS + idx % BS
            visible = (idx > n - 1 - window) if window else torch.ones(n, dtype=torch.bool, device="cuda")
            ref = _ref(q[i : i + 1], k.view(-1, kv_heads, d)[slots], v.view(-1, kv_heads, d)[slots], visible[None],
                       d**-0.5, softcap)
            assert _rel(out[i : i + 1], ref) < (5e-3 if dtype == torch.float16 else 2e-2), (splits, i)


@pytest.mark.parametrize("window, softcap", [(40, None), (None, 30.0), (40, 20.0)])
def test_prefill_window_and_softcap(window, softcap):
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, d, dtype = 8, 2, 128, torch.bfloat16
    reqs = [(0, 90), (70, 30), (0, 3)]  # (tokens already cached, new tokens)
    blocks = sum(-(-(a + n) // BS) for a, n in reqs) + 3
    k, v = _cache(blocks, kv_heads, d, dtype, gen)
    tables = _tables([a + n for a, n in reqs], blocks, gen)
    q = torch.randn(sum(n for _, n in reqs), heads, d, device="cuda", generator=gen).to(dtype) * 3
    cu_q, cu_k, kv_index = [0], [0], []
    for i, (a, n) in enumerate(reqs):
        idx = torch.arange(a + n, device="cuda")
        kv_index.append(tables[i, idx // BS].long() * BS + idx % BS)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + a + n)
    t32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    rows = pa.PrefillRows(cu_q[-1], t32(cu_q), t32(cu_k), torch.cat(kv_index), 90, 100)
    out = torch.full_like(q, float("nan"))
    pa.prefill_varlen(out, q, k, v, rows, d**-0.5, window, softcap)
    for i, (a, n) in enumerate(reqs):
        pos_q = a + torch.arange(n, device="cuda")[:, None]
        pos_k = torch.arange(a + n, device="cuda")[None, :]
        visible = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window else True)
        ref = _ref(q[cu_q[i] : cu_q[i + 1]], k.view(-1, kv_heads, d)[kv_index[i]], v.view(-1, kv_heads, d)[kv_index[i]],
                   visible, d**-0.5, softcap)
        assert _rel(out[cu_q[i] : cu_q[i + 1]], ref) < 2e-2, i
