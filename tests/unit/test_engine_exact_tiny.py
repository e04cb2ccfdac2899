"""Random PEFT adapters of ranks {1, 8, 16, 64} on different target subsets, mixed in
one batch with the base model on a tiny random GQA Llama, equal HF + PEFT greedy."""

import random

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import hf_greedy, make_random_adapter, run_to_completion

ADAPTERS = {
    "r1": dict(rank=1, targets=["q_proj", "v_proj"]),
    "r8": dict(rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], alpha=4),
    "r16": dict(rank=16, targets=["o_proj", "down_proj", "up_proj"], rslora=True),
    "r64": dict(rank=64, targets=["k_proj", "gate_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_random_adapter(tiny_model_dir, root / name, seed=i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }


def test_mixed_adapters_one_batch_equal_peft(tiny_model_dir, adapters):
    rng = random.Random(1)
    cfg = EngineConfig(max_lora_rank=64, max_loras=4, num_kv_blocks=64, block_size=8, max_tokens_per_step=96)
    engine = build_engine(tiny_model_dir, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)
    jobs = []  # (join step, request id, adapter, prompt, max_tokens)
    for i, adapter in enumerate([None, *adapters, None, *adapters]):
        prompt = [rng.randrange(320) for _ in range(rng.randint(3, 40))]
        jobs.append((rng.randint(0, 12), f"q{i}", adapter, prompt, rng.randint(20, 48)))
    requests = {}
    for step, rid, adapter, prompt, n in jobs:
        req = GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0), adapter)
        requests.setdefault(step, []).append(req)
    tokens, reasons, migrates = run_to_completion(engine, requests)
    assert not migrates
    assert engine.max_batch_seen >= 8, "requests were not batched together"
    changed = 0
    for _, rid, adapter, prompt, n in jobs:
        ref = hf_greedy(tiny_model_dir, adapters[adapter] if adapter else None, prompt, n)
        assert tokens[rid] == ref, f"{rid} ({adapter}) differs from HF+PEFT"
        assert reasons[rid] == "length"
        changed += adapter is not None and ref != hf_greedy(tiny_model_dir, None, prompt, n)
    assert changed >= 6, "the random adapters barely change the output: the test would not catch a dropped LoRA"
    assert engine.allocator.num_free == cfg.num_kv_blocks
