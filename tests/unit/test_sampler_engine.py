"""Seeded sampling through the engine (tiny random Llama, CPU): a seeded request generates the same
tokens alone, inside a batch of 16 mixed requests (greedy, other seeds, top-k/top-p, logprobs,
min_tokens, adapters, late arrivals), and resumed after a migration; another seed differs.
min_tokens holds EOS and stop token ids back, ignore_eos lets EOS through, logprobs come per token."""

import dataclasses
import random

import pytest

from app.engine.batch import build_step
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import make_random_adapter, run_to_completion

PROMPT = (17, 4, 250, 3, 99, 41, 8)
TARGET = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling-adapters")
    return {
        name: str(make_random_adapter(tiny_model_dir, root / name, rank=4, targets=["q_proj", "down_proj"], seed=i))
        for i, name in enumerate(["x", "y"])
    }


def _engine(tiny_model_dir, adapters, **kw):
    cfg = EngineConfig(**{"num_kv_blocks": 256, "block_size": 4, "max_loras": 2, **kw})
    return build_engine(tiny_model_dir, cfg, adapters, tokenizer=None)


def _alone(tiny_model_dir, adapters, request):
    tokens, _, _ = run_to_completion(_engine(tiny_model_dir, adapters), {0: [request]})
    return tokens[request.request_id]


def _mixed(n: int, rng: random.Random, prefix: str = "m") -> list[GenerateRequest]:
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=18, temperature=0.8, seed=5),
        SamplingParams(max_tokens=30, temperature=1.1, top_k=5),
        SamplingParams(max_tokens=16, temperature=0.7, top_p=0.8, logprobs=3),
        SamplingParams(max_tokens=22, temperature=0.0, logprobs=1, min_tokens=10, stop_token_ids=(7, 9)),
        SamplingParams(max_tokens=12, temperature=1.0, min_tokens=12, stop_token_ids=(2,)),
    ]
    return [
        GenerateRequest(
            f"{prefix}{i}",
            tuple(rng.randrange(320) for _ in range(rng.randint(2, 30))),
            kinds[i % len(kinds)],
            [None, "x", "y"][i % 3],
        )
        for i in range(n)
    ]


def test_seeded_request_alone_in_a_mixed_batch_and_after_a_migration(tiny_model_dir, adapters):
    adapter = "x"
    target = GenerateRequest("t", PROMPT, TARGET, adapter)
    alone = _alone(tiny_model_dir, adapters, target)
    assert len(alone) == TARGET.max_tokens

    rng = random.Random(0)
    other_seed = GenerateRequest("t2", PROMPT, dataclasses.replace(TARGET, seed=1235), adapter)
    batch = {0: _mixed(8, rng) + [other_seed], 2: [target] + _mixed(6, rng, "late")}  # 16 requests, some join late
    engine = _engine(tiny_model_dir, adapters)
    tokens, _, _ = run_to_completion(engine, batch)
    assert engine.max_batch_seen >= 12
    assert tokens["t"] == alone
    assert tokens["t2"] != alone, "another seed drew the same 24 tokens"

    resumed = dataclasses.replace(target, resume_token_ids=tuple(alone[:10]))  # as GenerateRequest.resumed makes it
    tokens, _, _ = run_to_completion(_engine(tiny_model_dir, adapters), {0: _mixed(15, random.Random(1)) + [resumed]})
    assert tokens["t"] == alone[10:]


def test_min_tokens_holds_eos_and_stop_ids_back(tiny_model_dir, adapters):
    """The tiny model has no EOS: the engine is given one, the 4th token of a greedy run."""
    engine = _engine(tiny_model_dir, adapters)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    free = _alone(tiny_model_dir, adapters, GenerateRequest("g", PROMPT, greedy))
    eos = free[3]
    first = free.index(eos)
    cfg = engine.model.cfg
    engine.model.cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))

    def run(params, rid):
        tokens, reasons, _ = run_to_completion(engine, {0: [GenerateRequest(rid, PROMPT, params)]})
        return tokens[rid], reasons[rid]

    assert run(greedy, "a") == (free[: first + 1], "stop")
    held, _ = run(dataclasses.replace(greedy, min_tokens=first + 4), "b")
    assert eos not in held[: first + 4] and len(held) >= first + 4
    assert run(dataclasses.replace(greedy, ignore_eos=True), "c") == (free, "length")
    stop = free[first + 2]  # a stop token id after EOS is suppressed too, and ends the request once allowed
    if stop != eos:
        held, _ = run(dataclasses.replace(greedy, min_tokens=first + 4, stop_token_ids=(stop,)), "d")
        assert not {eos, stop} & set(held[: first + 4])
    sampled = SamplingParams(max_tokens=16, temperature=0.3, seed=3, min_tokens=16)
    assert eos not in run(sampled, "e")[0]
    engine.model.cfg = cfg


def test_logprobs_per_token(tiny_model_dir, adapters):
    engine = _engine(tiny_model_dir, adapters)
    reqs = [
        GenerateRequest("g", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)),
        GenerateRequest("s", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=2, logprobs=0)),
        GenerateRequest("n", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=2)),
    ]
    for r in reqs:
        engine.add(r)
    chunks = []
    while engine.has_work():
        chunks += engine.step()
    by_id = {r.request_id: [c for c in chunks if c.request_id == r.request_id] for r in reqs}
    for c in by_id["g"]:
        (lp,) = c.logprobs
        assert lp["token_id"] == c.token_ids[0] == lp["top"][0][0] and len(lp["top"]) == 3
        assert lp["logprob"] == lp["top"][0][1] <= 0 and lp["top"][0][1] >= lp["top"][1][1] >= lp["top"][2][1]
    for c in by_id["s"]:
        (lp,) = c.logprobs
        assert lp["token_id"] == c.token_ids[0] and lp["top"] == [] and lp["logprob"] <= 0
    assert all(c.logprobs is None for c in by_id["n"])
    assert [c.token_ids for c in by_id["s"]] == [c.token_ids for c in by_id["n"]]  # logprobs change no draw


class _EagerGraphs:
    """DecodeGraphs' contract, run eagerly on the CPU: the logits of one decode step of `order`, whose
    input tokens are given on the device (next_tokens) for a step launched ahead."""

    max_batch = 32

    def __init__(self, engine):
        self.engine = engine

    def run(self, order, next_tokens=None):
        pending = next_tokens[0][next_tokens[1]].tolist() if next_tokens is not None else []
        for seq, token in zip(order, pending):  # the token the host has not appended yet
            seq.output_ids.append(token)
        e = self.engine
        inputs, _ = build_step([(s, 1) for s in order], e.model.lora_pool, e.config.block_size, "cpu", 1)
        for seq in order[: len(pending)]:
            seq.output_ids.pop()
        return self.engine.model.forward(inputs, self.engine.kv)


def test_sampled_steps_launched_ahead_draw_what_steps_run_in_turn_do(tiny_model_dir, adapters):
    """The run-ahead path on the CPU: seeded top-p / top-k, min_tokens with stop ids, logprobs and
    greedy rows; a step launched ahead draws with each row one token further (position, min_tokens)."""
    rng = random.Random(5)
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=1, logprobs=2),
        SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=2),
        SamplingParams(max_tokens=14, temperature=1.0, min_tokens=9, stop_token_ids=(5, 6, 7, 8), seed=3),
        SamplingParams(max_tokens=14, temperature=0.0, logprobs=1),
    ]
    requests = {
        k: [
            GenerateRequest(
                f"s{k}_{i}",
                tuple(rng.randrange(320) for _ in range(rng.randint(2, 20))),
                kinds[i % len(kinds)],
                [None, "x", "y"][i % 3],
            )
            for i in range(8)
        ]
        for k in (0, 9)
    }
    out = {}
    for ahead in (True, False):
        engine = _engine(tiny_model_dir, adapters, max_num_seqs=8)
        engine.runner.graphs = _EagerGraphs(engine)
        if not ahead:
            engine.runner.run_ahead = lambda result, scheduler: None
        chunks = {}
        step = 0
        while engine.has_work() or step <= 9:
            for r in requests.get(step, []):
                engine.add(r)
            for c in engine.step():
                chunks.setdefault(c.request_id, []).append((c.token_ids, c.logprobs, c.finish_reason))
            step += 1
        out[ahead] = chunks, engine.runner.steps_taken_ahead
    assert out[True][0] == out[False][0]
    assert out[True][1] >= 15, out[True][1]
