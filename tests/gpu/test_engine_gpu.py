"""The whole engine on CUDA (SGMV kernels, fp16/bf16) against HF transformers + PEFT on
the same GPU: greedy tokens of a mixed-adapter batch."""

import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import make_random_adapter, run_to_completion

pytestmark = pytest.mark.gpu

ADAPTERS = {
    "all16": dict(rank=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv8": dict(rank=8, targets=["q_proj", "v_proj"]),
    "mlp64": dict(rank=64, targets=["gate_proj", "up_proj", "down_proj"], rslora=True),
}
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.05,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    path = tmp_path_factory.mktemp("gpu-llama")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    adapters = {
        n: make_random_adapter(path, path / "adapters" / n, seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())
    }
    return path, adapters


def _hf_logits(path, adapter_dir, tokens, dtype, attn_implementation=None):
    """HF (+ PEFT) logits [len(tokens), vocab] in fp32, teacher-forced along ``tokens``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation).cuda()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).to(dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens], device="cuda")).logits[0].float()


def _first_disagreement(prompt, out, logits, logits32):
    """(index of the first generated token that is not HF's greedy choice, whether that is
    within HF's own rounding: our token is fp32 HF's choice, or its fp16/bf16 logit margin is
    no larger than twice the fp16/bf16-vs-fp32 error of HF's logits at that position)."""
    for t, token in enumerate(out):
        pos = len(prompt) - 1 + t
        row, row32 = logits[pos], logits32[pos]
        top = int(row.argmax())
        if top != token:
            noise = float((row - row32).abs().max())
            return t, int(row32.argmax()) == token or float(row[top] - row[token]) <= 2 * noise
    return None, True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_engine_on_gpu_matches_peft(gpu_model, dtype):
    """Every generated token is HF+PEFT's greedy choice given the same prefix, except at a
    near-tie of HF's own logits (fp16/bf16 rounding may then pick either; the two runs
    legitimately diverge after it), and most requests match exactly end to end."""
    path, adapters = gpu_model
    cfg = EngineConfig(max_lora_rank=64, max_loras=4, num_kv_blocks=256, dtype=dtype, device="cuda")
    check_mixed_batch_matches_peft(
        build_engine(path, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None),
        path,
        adapters,
        dtype,
        vocab=512,
    )


def check_mixed_batch_matches_peft(
    engine, path, adapters, dtype, vocab, names=None, max_prompt=60, attn_implementation=None, min_exact=None
):
    """The check above, for an engine over the checkpoint ``path`` with ``adapters`` registered;
    one request per entry of ``names`` (adapter or None), prompts of 4 to max_prompt tokens;
    at least ``min_exact`` of them exact end to end (default: 3/4 in fp16, 1/2 in bf16)."""
    rng = random.Random(0)
    names = names or [None, *adapters, *adapters, None, "qv8", "all16"]
    jobs = [
        (f"g{i}", a, [rng.randrange(vocab) for _ in range(rng.randint(4, max_prompt))]) for i, a in enumerate(names)
    ]
    requests = {}
    for i, (rid, a, p) in enumerate(jobs):
        req = GenerateRequest(rid, tuple(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), a)
        requests.setdefault(i % 3, []).append(req)
    tokens, _, _ = run_to_completion(engine, requests)
    exact, report = 0, []
    for rid, a, p in jobs:
        adapter = adapters[a] if a else None
        seq = p + tokens[rid]
        t, within = _first_disagreement(
            p,
            tokens[rid],
            _hf_logits(path, adapter, seq, dtype, attn_implementation),
            _hf_logits(path, adapter, seq, torch.float32, attn_implementation),
        )
        exact += t is None
        report.append((rid, a, t, within))
    print(dtype, "graphs" if engine.runner.graphs else "eager", report)
    assert all(within for *_, within in report), report
    # bf16's 8-bit mantissa makes ties common over 24 tokens: on the H200, 6 of 10 were exact
    # (every divergence within HF's own bf16 error); fp16 keeps the stricter bar.
    if min_exact is None:
        min_exact = len(jobs) * (3 if dtype == torch.float16 else 2) // 4
    assert exact >= min_exact, report
