"""Prompt logprobs (`echo` + `logprobs` on /v1/completions; app/engine/prompt_logprobs.py) equal HF
transformers' (+ PEFT) log-softmax over the prompt within 1e-4 in float32 on the CPU, for the base
model and an adapter: with the prompt cut into several prefill chunks, batched beside a plain
request, and after the same prompt filled the prefix cache (its shortcut must not be taken)."""

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.errors import InvalidRequestError
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from tests.support.helpers import _hf_model, make_random_adapter

TOP = 3


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(
        tiny_model_dir, tmp_path_factory.mktemp("plp") / "ad", rank=8, targets=["q_proj", "v_proj", "down_proj"]
    )


def _reference(model_dir, adapter_dir, prompt):
    with torch.no_grad():
        logits = _hf_model(model_dir, adapter_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _first_chunks(engine, requests):
    """Each request's first TokenChunk, the requests added together and stepped to the end."""
    for r in requests:
        engine.add(r)
    first = {}
    while engine.has_work():
        for chunk in engine.step():
            assert isinstance(chunk, TokenChunk), chunk
            first.setdefault(chunk.request_id, chunk)
    return first


def test_prompt_logprobs_equal_hf(tiny_model_dir, adapter):
    cfg = EngineConfig(max_lora_rank=8, max_loras=2, num_kv_blocks=64, block_size=4, max_tokens_per_step=16)
    engine = build_engine(tiny_model_dir, cfg, {"ad": str(adapter)}, tokenizer=None)
    prompt = tuple((7 * i + 3) % 320 for i in range(37))  # 37 tokens: three prefill chunks of at most 16
    warm = GenerateRequest("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    _first_chunks(engine, [warm])  # the prompt's full blocks are in the prefix cache now
    assert engine.allocator.num_cached > 0
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=TOP)
    asks = [
        GenerateRequest("base", prompt, params),
        GenerateRequest("lora", prompt, params, "ad"),
        GenerateRequest("plain", prompt[:9], SamplingParams(max_tokens=3, temperature=0.0)),
    ]
    first = _first_chunks(engine, asks)
    assert first["plain"].prompt_logprobs is None
    for rid, adapter_dir in (("base", None), ("lora", adapter)):
        got = first[rid].prompt_logprobs
        ref = _reference(tiny_model_dir, adapter_dir, list(prompt))
        assert len(got) == len(prompt) and got[0] is None
        for p, entry in enumerate(got[1:], start=1):
            assert entry["token_id"] == prompt[p]
            assert abs(entry["logprob"] - ref[p - 1, prompt[p]].item()) < 1e-4
            top_v, top_i = ref[p - 1].topk(TOP)
            assert [t for t, _ in entry["top"]] == top_i.tolist()
            assert max(abs(v - r) for (_, v), r in zip(entry["top"], top_v.tolist())) < 1e-4
    base, lora = first["base"].prompt_logprobs, first["lora"].prompt_logprobs
    assert any(abs(a["logprob"] - b["logprob"]) > 1e-3 for a, b in zip(base[1:], lora[1:])), (
        "the adapter changed nothing"
    )
    assert engine.allocator.num_free == cfg.num_kv_blocks  # cached blocks count as free


def test_prompt_logprobs_refused_for_several_choices(tiny_model_dir):
    engine = build_engine(tiny_model_dir, EngineConfig(num_kv_blocks=16, block_size=4), tokenizer=None)
    with pytest.raises(InvalidRequestError, match="one choice"):
        engine.add(GenerateRequest("x", (1, 2, 3), SamplingParams(prompt_logprobs=1), n=2))


def test_a_request_requeued_mid_prefill_reports_each_prompt_logprob_once(tiny_model_dir):
    """Preempted while its prompt is half computed, and requeued by the scheduler (a lone replica):
    its prompt logprobs are computed again from the start, not appended to the first attempt's."""
    cfg = EngineConfig(num_kv_blocks=13, block_size=4, max_tokens_per_step=16, requeue_preempted=True)
    engine = build_engine(tiny_model_dir, cfg, tokenizer=None)
    prompt = tuple((7 * i + 3) % 320 for i in range(37))  # 10 blocks with its first token
    # the older request fills 3 blocks and grows: the newer one is preempted before its prompt is done
    older = GenerateRequest("older", tuple(range(12)), SamplingParams(max_tokens=6, temperature=0.0))
    asks = GenerateRequest("asks", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP))
    first = _first_chunks(engine, [older, asks])
    assert engine.preemptions > 0
    got = first["asks"].prompt_logprobs
    ref = _reference(tiny_model_dir, None, list(prompt))
    assert len(got) == len(prompt) and got[0] is None
    assert all(abs(e["logprob"] - ref[p - 1, prompt[p]].item()) < 1e-4 for p, e in enumerate(got[1:], start=1))
