"""Mixed steps as graph pieces (app/engine/mixed_graphs.py), on the CPU: which bucket a step replays
is a pure function of its token count, and a step padded to its bucket the way the pieces see it
(fill_host's inputs: padding rows, the LoRA padding run and empty segments, sampled rows padded)
computes exactly the logits of the eager step, in float64. The capture itself needs CUDA
(tests/gpu/test_mixed_graphs_gpu.py)."""

import random

import numpy as np
import pytest
import torch

from app.engine.batch import attention_rows, build_step, step_rows
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.mixed_graphs import fill_host, pick, token_buckets
from app.model.inputs import LoraSegments, StepInputs
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import make_random_adapter


def test_buckets_and_pick_depend_on_the_token_count_only():
    b = token_buckets(1024)
    assert b == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert token_buckets(300) == [64, 128, 192, 256, 300]
    assert token_buckets(40) == [40]
    for tokens in range(1, 1025):
        t = pick(tokens, b)
        assert t >= tokens and t == min(x for x in b if x >= tokens)
        assert t - tokens < (64 if tokens <= 512 else 128)  # the padding bound the docstring gives
    assert pick(1025, b) is None  # past the largest: eager


def _padded_inputs(order_rows, t_max, rows_max, t, pool):
    segs, modules = rows_max + 1, list(pool.has_module)
    h = {
        "tokens": np.full(t_max, 7, np.int32),  # stale values: fill_host must overwrite what it uses
        "positions": np.full(t_max, 3, np.int32),
        "slots": np.full(t_max, 5, np.int32),
        "sample": np.full(rows_max, 9, np.int32),
        "indptr": np.full(segs + 1, 4, np.int32),
        "slot_ids": np.full((len(modules), segs), 2, np.int32),
    }
    lora = fill_host(h, t, order_rows, {m: v.numpy() for m, v in pool.has_module.items()})
    d = {k: torch.from_numpy(v.copy()) for k, v in h.items()}
    # the CPU's add-on in the model's dtype reads host segments (the reference's is fp32): these are
    # read off the padded device-side inputs, so they check them too
    bounds = h["indptr"].tolist()
    host = {
        m: tuple(
            (bounds[i], bounds[i + 1], s, pool.slot_rank[s], pool.slot_scale[s])
            for i, s in enumerate(h["slot_ids"][j].tolist())
            if s >= 0
        )
        for j, m in enumerate(modules)
    }
    segments = LoraSegments(d["indptr"], {m: d["slot_ids"][j] for j, m in enumerate(modules)}, host)
    return h, d, lora, segments


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed-adapters")
    adapters = {
        "a": make_random_adapter(tiny_model_dir, root / "a", rank=8, targets=["q_proj", "v_proj", "down_proj"]),
        "b": make_random_adapter(tiny_model_dir, root / "b", rank=4, targets=["o_proj", "gate_proj"], seed=1),
    }
    cfg = EngineConfig(
        max_num_seqs=6, num_kv_blocks=96, block_size=8, max_tokens_per_step=40, max_loras=4, dtype=torch.float64
    )
    return build_engine(tiny_model_dir, cfg, {k: str(v) for k, v in adapters.items()}, tokenizer=None)


def test_a_padded_step_computes_the_eager_steps_logits(engine):
    rng = random.Random(3)
    for i, adapter in enumerate([None, "a", "b", "a", None, "b"]):
        prompt = tuple(rng.randrange(300) for _ in range(rng.randint(5, 30)))
        engine.add(GenerateRequest(f"m{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0), adapter))
    model, c = engine.model, engine.config
    pool = model.lora_pool
    checked = 0
    while engine.has_work():
        plan = engine.scheduler.schedule()
        sched = plan.scheduled
        if any(n > 1 for _, n in sched) and any(n == 1 for _, n in sched):  # a mixed step
            inputs, sampled = build_step(sched, pool, c.block_size, c.device, model.cfg.num_kv_heads)
            order, prefill, decode, (tokens, positions, slots, sample, seqs) = step_rows(sched, c.block_size)
            assert seqs == sampled
            n = len(tokens)
            t = pick(n, token_buckets(64))
            h, d, lora, segments = _padded_inputs((order, tokens, positions, slots, sample), 64, 6, t, pool)
            assert (h["slots"][n:t] == -1).all() and (h["tokens"][n:t] == 0).all() and h["indptr"][-1] == t
            assert lora == any(s.lora_slot >= 0 for s, _ in sched)
            padded = StepInputs(
                d["tokens"][:t],
                d["positions"][:t],
                d["slots"][:t],
                attention_rows(prefill, decode, n - len(decode), c.block_size, c.device, model.cfg.num_kv_heads),
                d["sample"].long(),
                segments if lora else None,
            )
            # the padded rows' KV slot −1 is the cache's last slot on the CPU path: no request holds it
            assert engine.allocator.num_free > 0
            want = model.forward(inputs, engine.kv)
            got = model.forward(padded, engine.kv)[: len(sampled)]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            checked += 1
        # carry on as the engine would (the step's KV written by the eager forward above or here)
        result = engine.runner.step(sched)
        for seq, k in sched:
            engine.scheduler.computed(seq, k)
        tokens_out, _ = result.sample()
        for s, tok in zip(result.sampled, tokens_out):
            engine._postprocess(s, tok, None)
    assert checked >= 2, "the workload made too few mixed steps to check"
