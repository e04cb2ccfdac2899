"""Structured output on the GPU: the masked draw equals the CPU's on the same logits and bitmask;
through CUDA-graph decode, constrained requests launched ahead (their draw waits for the previous
token: app/engine/run_ahead.py) generate what they generate with steps run in turn; an output that
ends with stop parses, one that ran to max_tokens still follows its grammar. The vocabulary is benchmarks/structured_throughput.py's synthetic
BPE (nothing to fetch on the device)."""

import json
import random

import numpy as np
import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.sampler import draw
from app.engine.step_sampling import StepSampling
from app.protocol import GenerateRequest, Guide, SamplingParams
from benchmarks.random_schemas import random_schemas
from benchmarks.structured_throughput import synthetic_tokenizer

pytestmark = pytest.mark.gpu
VOCAB = 8192


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    path = tmp_path_factory.mktemp("structured-gpu")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path, synthetic_tokenizer(VOCAB)


def test_the_masked_draw_equals_the_cpu_draw():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, VOCAB, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, (VOCAB + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 3, 4, 9, 12, 15])
    out = {}
    for device in ("cpu", "cuda"):
        sp = StepSampling(16, allowed=(rows.to(device), bits.to(device)))
        out[device] = draw(logits.to(device), sp).tokens.cpu()
    assert torch.equal(out["cpu"], out["cuda"])
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    for j, row in enumerate(rows.tolist()):
        assert allowed[j, out["cpu"][row]]


def test_constrained_requests_launched_ahead_equal_steps_run_in_turn(model_dir):
    path, tokenizer = model_dir
    rng = random.Random(2)
    schemas = random_schemas(24, seed=5)
    requests = [
        GenerateRequest(
            f"j{i}",
            tuple(rng.randrange(VOCAB) for _ in range(12)),
            SamplingParams(
                max_tokens=300, temperature=0.8, seed=i, guide=Guide("json_schema", json.dumps(s, sort_keys=True))
            ),
        )
        for i, s in enumerate(schemas)
    ]
    requests += [
        GenerateRequest(
            f"p{i}",
            tuple(rng.randrange(VOCAB) for _ in range(12)),
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
        for i in range(8)
    ]
    out = {}
    for ahead in (True, False):
        engine = build_engine(
            path,
            EngineConfig(max_num_seqs=32, num_kv_blocks=1024, dtype=torch.float16, device="cuda"),
            {},
            tokenizer=tokenizer,
        )
        assert engine.runner.graphs is not None
        if not ahead:
            engine.runner.run_ahead = lambda result, scheduler: None
        for r in requests:
            engine.add(r)
        text, reasons, ids = {r.request_id: "" for r in requests}, {}, {r.request_id: [] for r in requests}
        while engine.has_work():
            for chunk in engine.step():
                text[chunk.request_id] += chunk.text
                ids[chunk.request_id] += chunk.token_ids
                reasons[chunk.request_id] = chunk.finish_reason
        out[ahead] = text, reasons, engine.runner.steps_taken_ahead
    assert out[True][:2] == out[False][:2]
    assert out[True][2] >= 20, out[True][2]
    for i, r in enumerate(requests[: len(schemas)]):
        if out[True][1][r.request_id] == "stop":
            assert isinstance(json.loads(out[True][0][r.request_id]), dict)
            continue
        # a random model may wander in a number's unbounded fraction digits: then it ran to
        # max_tokens, and every token it drew still follows its grammar (replayed on a fresh matcher)
        assert out[True][1][r.request_id] == "length" and len(ids[r.request_id]) == r.params.max_tokens
        engine.grammars.state(engine.grammars.compile(r.params.guide), tuple(ids[r.request_id]))
