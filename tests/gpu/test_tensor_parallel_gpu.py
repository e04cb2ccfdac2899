"""Tensor parallelism on 2 GPUs (NCCL, NVLink multicast off): a Llama-2-7B-shaped model
(7B widths and heads, 2 layers) in fp16/bf16 with mixed-adapter batches against HF
transformers + PEFT, with the single-GPU test's criterion."""
import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.gpu.test_engine_gpu import _first_disagreement, _hf_logits
from tests.helpers import make_random_adapter, run_to_completion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

ADAPTERS = {
    "all16": dict(rank=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "attn8": dict(rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp64": dict(rank=64, targets=["gate_proj", "up_proj", "down_proj"], rslora=True),
}
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_7b_shape(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                      initializer_range=0.02, tie_word_embeddings=False, eos_token_id=None)
    path = tmp_path_factory.mktemp("llama-7b-shape")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    adapters = {n: make_random_adapter(path, path / "adapters" / n, seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    return path, adapters


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tp2_engine_on_two_gpus_matches_peft(model_7b_shape, dtype):
    path, adapters = model_7b_shape
    rng = random.Random(0)
    cfg = EngineConfig(max_lora_rank=64, max_loras=4, num_kv_blocks=256, dtype=dtype, device="cuda", tensor_parallel_size=2)
    engine = build_engine(path, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)
    jobs = [(f"g{i}", a, [rng.randrange(32000) for _ in range(rng.randint(4, 60))])
            for i, a in enumerate([None, *adapters, *adapters, None, "attn8", "all16"])]
    requests = {}
    for i, (rid, a, p) in enumerate(jobs):
        req = GenerateRequest(rid, tuple(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), a)
        requests.setdefault(i % 3, []).append(req)
    try:
        tokens, _, _ = run_to_completion(engine, requests)
    finally:
        engine.model.shutdown()
    exact, report = 0, []
    for rid, a, p in jobs:
        adapter = adapters[a] if a else None
        seq = p + tokens[rid]
        t, within = _first_disagreement(p, tokens[rid], _hf_logits(path, adapter, seq, dtype),
                                        _hf_logits(path, adapter, seq, torch.float32))
        exact += t is None
        report.append((rid, a, t, within))
    print(dtype, report)
    assert all(within for *_, within in report), report
    assert exact >= len(jobs) * (3 if dtype == torch.float16 else 2) // 4, report
