"""Mixed steps as graph pieces (app/engine/mixed_graphs.py) on the device: a step of prefill and
decode rows replayed as pieces gives the eager forward's logits within fp16 rounding (the padded
GEMMs may pick other cuBLAS kernels), for base, Distinct and mixed-rank adapters, at several
buckets; and the engine generates with pieces what it generates without them."""

import random

import pytest
import torch

from app.engine.batch import build_step
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.sequence import Sequence
from app.protocol import GenerateRequest, SamplingParams
from tests.gpu.test_cuda_graphs_gpu import adapter_slots, model_dir, random_kv  # noqa: F401 (fixture)
from tests.support.helpers import run_to_completion

pytestmark = pytest.mark.gpu


def mixed_engine(model_dir, mixed_tokens, max_batch=32):  # noqa: F811
    path, adapters = model_dir
    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_lora_rank=64,
        max_loras=8,
        num_kv_blocks=1024,
        dtype=torch.float16,
        device="cuda",
        max_tokens_per_step=1024,
        mixed_graph_tokens=mixed_tokens,
    )
    return build_engine(path, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)


def _step(engine, slots, rng, prefills, decodes):
    """A schedule of prefill chunks (some after cached context) and decode rows on random KV."""
    free = list(range(engine.config.num_kv_blocks))
    rng.shuffle(free)
    sched = []
    for i, (done, n) in enumerate(prefills + [(rng.randint(1, 400), 1) for _ in range(decodes)]):
        length = done + n
        seq = Sequence(
            GenerateRequest(f"r{i}", tuple(rng.randrange(512) for _ in range(length)), SamplingParams()), 0, i
        )
        seq.num_computed = done if n > 1 else length - 1
        seq.block_table = [free.pop() for _ in range(-(-length // 16))]
        seq.lora_slot = rng.choice([-1, *slots])
        sched.append((seq, n))
    return sched


@pytest.mark.parametrize("shape", [([(0, 40)], 5), ([(0, 200), (64, 90)], 20), ([(32, 600)], 31), ([(0, 130)], 0)])
def test_pieces_give_the_eager_forwards_logits(model_dir, shape):  # noqa: F811
    engine = mixed_engine(model_dir, 1024)
    assert engine.runner.mixed is not None
    slots = adapter_slots(engine)
    rng = random.Random(len(shape[0]) * 100 + shape[1])
    random_kv(engine, 1)
    sched = _step(engine, slots, rng, *shape)
    m, c = engine.model, engine.config
    got, sampled = engine.runner.mixed.run(sched)
    got = got.clone()
    inputs, want_sampled = build_step(sched, m.lora_pool, c.block_size, c.device, m.cfg.num_kv_heads)
    want = m.forward(inputs, engine.kv)
    assert sampled == want_sampled
    assert torch.isfinite(got).all()
    err = float((got - want).norm() / want.norm())
    assert err < 5e-3, err  # fp16 activations: other GEMM kernels round apart, nothing more


def test_engine_with_pieces_generates_what_it_does_without(model_dir):  # noqa: F811
    rng = random.Random(5)
    names = [None, *sorted(model_dir[1])]
    requests = {
        k: [
            GenerateRequest(
                f"m{k}_{i}",
                tuple(rng.randrange(512) for _ in range(rng.randint(3, 300))),
                SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0),
                names[(i + k) % len(names)],
            )
            for i in range(8)
        ]
        for k in (0, 5, 11, 17)  # arrivals while others decode: mixed steps
    }
    out = {}
    for tokens in (1024, 0):
        out[tokens], _, _ = run_to_completion(mixed_engine(model_dir, tokens), requests)
    same = sum(out[1024][r] == out[0][r] for r in out[0])
    assert same >= len(out[0]) - 3, (same, len(out[0]))  # fp16 near-ties may break either way
