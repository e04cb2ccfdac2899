"""Prefix caching on CUDA (paged prefill over a cached context, decode CUDA graphs, steps
launched ahead): greedy and seeded generations with the cache on are those with it off, for
tenants sharing system prompts under several adapters and the base model; nothing is shared
across weights; every block is free or cached at the end."""

import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.gpu.test_cuda_graphs_gpu import model_dir  # noqa: F401  (the fixture: 2 layers, 8 adapters a0..a7)
from tests.support.helpers import run_to_completion

pytestmark = pytest.mark.gpu
NAMES = (None, "a0", "a1", "a2")


def graph_engine(model_dir, cache: bool):
    path, adapters = model_dir
    cfg = EngineConfig(
        max_num_seqs=16,
        max_lora_rank=64,
        max_loras=4,
        num_kv_blocks=512,
        block_size=16,
        dtype=torch.float16,
        device="cuda",
        max_tokens_per_step=1024,
        prefix_caching=cache,
    )
    engine = build_engine(path, cfg, {n: str(adapters[n]) for n in NAMES[1:]}, tokenizer=None)
    assert engine.runner.graphs is not None, "the paged path with CUDA graphs must serve this test"
    return engine


def test_cache_on_generates_what_cache_off_does_with_cuda_graphs(model_dir):
    rng = random.Random(0)
    systems = {n: tuple(rng.randrange(512) for _ in range(rng.randint(100, 300))) for n in NAMES}
    requests = {}
    for k in range(24):  # arrivals spread over the run: later ones find their tenant's prefix cached
        name = NAMES[k % 4]
        params = (
            SamplingParams(max_tokens=20, temperature=0.0)
            if k % 3
            else SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=k)
        )
        prompt = systems[name] + tuple(rng.randrange(512) for _ in range(rng.randint(1, 40)))
        requests.setdefault(6 * k, []).append(GenerateRequest(f"r{k}", prompt, params, name))
    out = {}
    for cache in (False, True):
        engine = graph_engine(model_dir, cache)
        out[cache], reasons, _ = run_to_completion(engine, requests)
        assert set(reasons.values()) == {"length"}
        engine.allocator.check()
        assert engine.allocator.num_free == 512
    hits = engine.prefix.hit_tokens
    assert all(hits[n or ""] >= 5 * 96 for n in NAMES), hits  # each tenant's 5 later requests read its prompt
    assert engine.tokens_computed < 0.6 * sum(len(r.prompt_token_ids) + 20 for rs in requests.values() for r in rs)
    same = sum(out[True][r] == out[False][r] for r in out[True])
    assert same >= len(out[True]) - 2, (same, len(out[True]))  # fp16 near-ties may break either way


def test_no_hits_across_adapters_on_the_gpu(model_dir):
    prompt = tuple(random.Random(1).randrange(512) for _ in range(200))
    engine = graph_engine(model_dir, True)
    jobs = {
        4 * i: [GenerateRequest(f"q{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0), n)]
        for i, n in enumerate(NAMES)
    }
    run_to_completion(engine, jobs)
    assert sum(engine.prefix.hit_tokens.values()) == 0
    run_to_completion(
        engine, {0: [GenerateRequest("again", prompt, SamplingParams(max_tokens=8, temperature=0.0), "a1")]}
    )
    assert engine.prefix.hit_tokens["a1"] == 192
