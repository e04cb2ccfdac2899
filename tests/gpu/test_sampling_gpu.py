"""Sampling on the GPU: at every CUDA-graph bucket, a sampled batch replayed from the graph draws the
same tokens (and logprobs) as the same inputs run eagerly, and as the CPU sampler on the same logits;
a row draws alone what it draws in the batch; and sampled steps are launched ahead, generating
exactly what they generate run in turn."""

import random

import pytest
import torch

from app.engine.sampler import draw
from app.engine.step_sampling import Staging, step_sampling
from app.protocol import GenerateRequest, SamplingParams
from tests.gpu import test_cuda_graphs_gpu as graphs_test
from tests.gpu.test_cuda_graphs_gpu import adapter_slots, decode_rows, graph_engine, random_kv

pytestmark = pytest.mark.gpu
model_dir = graphs_test.model_dir  # the same tiny Llama and 8 adapters (a module-scoped fixture)
KINDS = [
    SamplingParams(max_tokens=4, temperature=0.0),
    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.95),
    SamplingParams(max_tokens=4, temperature=0.8, top_k=50),
    SamplingParams(max_tokens=4, temperature=1.0, logprobs=5),
    SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, min_tokens=4, stop_token_ids=(3, 5)),
    SamplingParams(max_tokens=4, temperature=0.7, top_k=20, top_p=0.9, min_tokens=4, stop_token_ids=(1,)),
]


def _with_params(rows, rng):
    for i, seq in enumerate(rows):
        seq.request = GenerateRequest(seq.request_id, seq.prompt_ids, KINDS[rng.randrange(len(KINDS))])
        seq.seed = rng.getrandbits(63)
    return rows


def _drawn(logits, rows, staging):
    d = draw(logits, step_sampling(rows, (2,), logits.shape[-1], staging))
    return [d.tokens.tolist()] + [None if t is None else t.cpu() for t in (d.logprob, d.top_logprobs)]


def test_sampled_graph_replay_equals_eager_at_every_bucket(model_dir):
    engine = graph_engine(model_dir, torch.float16)
    graphs, staging = engine.runner.graphs, Staging("cuda")
    random_kv(engine, 7)
    slots = adapter_slots(engine)
    rng = random.Random(8)
    checked = 0
    for size in graphs.buckets:
        for n in {size, max(1, size - 3)}:
            rows = _with_params(decode_rows(n, [rng.choice([-1, *slots]) for _ in range(n)], rng), rng)
            replayed = graphs.run(rows)
            got = _drawn(replayed, rows, staging)  # queued right behind the replay, as the runner does
            bucket = graphs._buckets[next(b for b in graphs.buckets if b >= n)]
            lora = any(s.lora_slot >= 0 for s in rows)
            eager = engine.model.forward(bucket.inputs(lora, engine.model.cfg.num_kv_heads), engine.kv)[:n]
            want = _drawn(eager, rows, staging)
            assert got[0] == want[0], (size, n)
            for a, b in zip(got[1:], want[1:]):
                assert (a is None and b is None) or torch.equal(a, b), (size, n)
            on_cpu = _drawn(eager.cpu(), rows, Staging("cpu"))
            assert on_cpu[0] == want[0], (size, n)
            alone = [_drawn(eager[i : i + 1], [s], staging)[0][0] for i, s in enumerate(rows)]
            assert alone == want[0], (size, n)
            checked += 1
    assert checked >= len(graphs.buckets)


def _generate(model_dir, requests, ahead):
    engine = graph_engine(model_dir, torch.float16)
    if not ahead:
        engine.runner.run_ahead = lambda out, scheduler: None
    chunks = {}
    step = 0
    while engine.has_work() or any(k >= step for k in requests):
        for r in requests.get(step, []):
            engine.add(r)
        for c in engine.step():
            chunks.setdefault(c.request_id, []).append((c.token_ids, c.logprobs, c.finish_reason))
        step += 1
    return chunks, engine.runner.steps_taken_ahead


def test_sampled_steps_launched_ahead_generate_what_steps_run_in_turn_do(model_dir):
    """Seeded top-p / top-k, min_tokens with stop ids, logprobs and greedy rows, one length per wave
    (the steps launched ahead are the steps the scheduler plans): bit-identical tokens and logprobs
    with and without launching ahead, and most steps taken ahead."""
    rng = random.Random(9)
    names = [None, *sorted(model_dir[1])]
    kinds = [
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1),
        SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=2),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=24, stop_token_ids=(3, 4)),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=5),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=2),
    ]
    requests = {
        k: [
            GenerateRequest(
                f"s{k}_{i}",
                tuple(rng.randrange(512) for _ in range(rng.randint(3, 60))),
                kinds[i % len(kinds)],
                names[(i + k) % len(names)],
            )
            for i in range(12)
        ]
        for k in (0, 30)
    }
    on, taken = _generate(model_dir, requests, ahead=True)
    off, _ = _generate(model_dir, requests, ahead=False)
    assert on == off
    assert taken >= 30, taken
