"""The embedded SmolLM2-135M-Instruct: base + example adapters in one batch equal
HF transformers + PEFT token for token; stop strings, stop tokens, min_tokens, logprobs."""

from pathlib import Path

import pytest

from adapters_store.sources import local_adapters
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.generate import EXAMPLE_ADAPTERS
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import hf_greedy_batch, run_to_completion

pytestmark = pytest.mark.slow  # SmolLM2-135M against HF transformers + PEFT

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a short poem about the sea.",
]
RAW = ["The three primary colors are", "def add(a, b):\n"]
NEW_TOKENS = 32  # long enough to diverge wherever the weights or an adapter differ; CI time is per token


@pytest.fixture(scope="module")
def engine(default_model_dir):
    adapters = local_adapters(EXAMPLE_ADAPTERS)
    assert len(adapters) >= 2, "example adapters missing under examples/adapters"
    return build_engine(default_model_dir, EngineConfig(max_lora_rank=64, max_loras=4, num_kv_blocks=1024), adapters)


def _chat(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _greedy(**kw):
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def test_base_and_example_adapters_in_one_batch_equal_peft(engine, default_model_dir):
    tok = engine.tokenizer
    prompts = [_chat(tok, p) for p in PROMPTS] + [tok(p)["input_ids"] for p in RAW]
    names = [None, *engine.adapters.names()]
    requests, jobs = {}, []
    for i, (adapter, prompt) in enumerate((a, p) for a in names for p in prompts):
        rid = f"{adapter or 'base'}-{i}"
        join = (i * 3) % 7  # requests join at different steps; ignore_eos keeps lengths fixed
        requests.setdefault(join, []).append(GenerateRequest(rid, tuple(prompt), _greedy(), adapter))
        jobs.append((rid, adapter, prompt))
    tokens, reasons, _ = run_to_completion(engine, requests)
    assert engine.max_batch_seen >= len(jobs) - len(requests[0]) // 2
    adapter_dirs = local_adapters(EXAMPLE_ADAPTERS)
    for adapter in names:  # one batched HF call per adapter (left-padded, masked)
        mine = [(rid, prompt) for rid, a, prompt in jobs if a == adapter]
        adapter_dir = Path(adapter_dirs[adapter]) if adapter else None
        refs = hf_greedy_batch(default_model_dir, adapter_dir, [p for _, p in mine], NEW_TOKENS, ignore_eos=True)
        for (rid, _), ref in zip(mine, refs, strict=True):
            assert tokens[rid] == ref, f"{rid}: engine {tok.decode(tokens[rid])!r} != HF {tok.decode(ref)!r}"
    assert engine.allocator.num_free == engine.config.num_kv_blocks


def _run_one(engine, prompt, params, adapter=None):
    chunks = []
    engine.add(GenerateRequest("one", tuple(prompt), params, adapter))
    while engine.has_work():
        chunks += engine.step()
    return chunks


def test_stop_string_across_token_boundary(engine):
    tok = engine.tokenizer
    prompt = _chat(tok, "Tell me about the moon.")
    full = _run_one(engine, prompt, _greedy())
    text = "".join(c.text for c in full)
    ids = [t for c in full for t in c.token_ids]
    # a stop string made of the end of token 10 and the start of token 11
    left, right = tok.decode(ids[:11]), tok.decode(ids[:12])
    stop = left[-2:] + right[len(left) :][:2]
    assert stop in text
    cut = _run_one(engine, prompt, _greedy(stop=(stop,)))
    assert cut[-1].finish_reason == "stop"
    assert "".join(c.text for c in cut) == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(engine):
    tok = engine.tokenizer
    prompt = _chat(tok, "Count from one to twenty.")
    ids = [t for c in _run_one(engine, prompt, _greedy()) for t in c.token_ids]
    target = ids[5]
    first = ids.index(target)
    stopped = [t for c in _run_one(engine, prompt, _greedy(stop_token_ids=(target,))) for t in c.token_ids]
    assert stopped == ids[: first + 1]
    later = _run_one(engine, prompt, _greedy(stop_token_ids=(target,), min_tokens=first + 3))
    out = [t for c in later for t in c.token_ids]
    assert len(out) >= first + 3 and target not in out[: first + 2]


def test_logprobs(engine):
    tok = engine.tokenizer
    prompt = _chat(tok, "Say hello.")
    chunks = _run_one(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))
    for c in chunks:
        (lp,) = c.logprobs
        assert lp["token_id"] == c.token_ids[0] == lp["top"][0][0]
        assert lp["logprob"] <= 0 and len(lp["top"]) == 3
        assert lp["top"][0][1] >= lp["top"][1][1] >= lp["top"][2][1]
