"""Chunked prefill under a token budget (EngineConfig.max_tokens_per_step), issue 44.

The scheduler alone (no model): running decode rows are planned every step however long the
prompts beside them, a prompt's chunks add up to it exactly, and a step never exceeds the budget.
Then a float64 engine: chunked prompts, with preemption, prefix-cache hits and a migration landing
inside them, generate exactly what unchunked prompts generate."""

import random

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.kv_cache import BlockAllocator
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.protocol import GenerateRequest, Migrate, SamplingParams

BS = 4


def _seq(i, prompt, max_tokens):
    return Sequence(GenerateRequest(f"r{i}", tuple(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens)), 0, i)


def _simulate(budget, arrivals, max_batch=8, blocks=400, steps=400):
    """Run the scheduler with a stand-in model (every sampled row gets token 7); returns per step
    (plan, decode rows running before it) and each request's scheduled token counts."""
    sched = Scheduler(
        EngineConfig(max_num_seqs=max_batch, num_kv_blocks=blocks, block_size=BS, max_tokens_per_step=budget),
        BlockAllocator(blocks),
        None,
    )
    chunks: dict[str, list[int]] = {}
    log = []
    for step in range(steps):
        for seq in arrivals.get(step, []):
            sched.waiting.append(seq)
        decoding = [s for s in sched.running if s.num_uncomputed == 1]
        plan = sched.schedule()
        assert not plan.preempted
        assert sum(n for _, n in plan.scheduled) <= budget
        log.append((plan, decoding))
        for seq, n in plan.scheduled:
            chunks.setdefault(seq.request_id, []).append(n)
            sched.computed(seq, n)
        for seq, n in plan.scheduled:
            if seq.num_computed == seq.num_tokens:  # sampled
                seq.output_ids.append(7)
                if len(seq.output_ids) >= seq.params.max_tokens:
                    sched.remove(seq)
        if not sched.running and not sched.waiting and step > max(arrivals):
            break
    return log, chunks


@pytest.mark.parametrize("budget", [16, 33, 64])
def test_decode_rows_run_every_step_beside_long_prompts(budget):
    rng = random.Random(budget)
    arrivals = {}
    for i in range(14):
        long = i % 3 == 0
        prompt = rng.randint(150, 400) if long else rng.randint(3, 20)
        arrivals.setdefault(rng.randint(0, 60), []).append(_seq(i, prompt, rng.randint(3, 30)))
    log, chunks = _simulate(budget, arrivals)
    chunked = 0
    for plan, decoding in log:
        planned = {id(s): n for s, n in plan.scheduled}
        # a running decode row is never delayed, by a long prompt or anything else
        assert all(planned.get(id(s)) == 1 for s in decoding)
        chunked += any(n > 1 and s.num_computed < len(s.prompt_ids) for s, n in plan.scheduled)
    assert chunked > 0
    for seqs in arrivals.values():
        for seq in seqs:
            c = chunks[seq.request_id]
            prefill = c[: len(c) - (seq.params.max_tokens - 1)]
            assert sum(prefill) == len(seq.prompt_ids), (seq.request_id, c)  # the chunks add up to the prompt
            assert all(n == 1 for n in c[len(prefill) :])  # then one token a step
            assert len(prefill) >= -(-len(seq.prompt_ids) // budget)


def _engine(model_dir, budget, blocks=200, batch=4):
    cfg = EngineConfig(
        max_num_seqs=batch, num_kv_blocks=blocks, block_size=8, max_tokens_per_step=budget, dtype=torch.float64
    )
    return build_engine(model_dir, cfg, None, tokenizer=None)


def _run(engine, requests, on_step=None, max_steps=3000):
    """Greedy tokens of each request; Migrate chunks are resubmitted as resumed requests."""
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        engine.add(r)
    tokens = {r.request_id: [] for r in requests}
    _run.preempted = 0
    for step in range(max_steps):
        if not engine.has_work():
            break
        for c in on_step(engine, step) if on_step else []:
            engine.add(by_id[c.request_id].resumed(c))
        for c in engine.step():
            if isinstance(c, Migrate):
                _run.preempted += 1
                engine.add(by_id[c.request_id].resumed(c))
            elif hasattr(c, "token_ids"):
                tokens[c.request_id] += list(c.token_ids)
    assert not engine.has_work()
    return tokens


def _requests(seed, n=4, shared=0, new=(3, 8)):
    rng = random.Random(seed)
    head = [rng.randrange(300) for _ in range(shared)]
    return [
        GenerateRequest(
            f"q{i}",
            tuple(head + [rng.randrange(300) for _ in range(rng.randint(20, 50))]),
            SamplingParams(max_tokens=rng.randint(*new), temperature=0.0),
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def unchunked(tiny_model_dir):
    """Each workload's tokens with a budget no prompt reaches (no chunking)."""
    return {
        key: _run(_engine(tiny_model_dir, 4096, blocks=400, batch=8), _requests(*args))
        for key, args in {"plain": (1,), "shared": (2, 4, 40), "long": (3, 4, 0, (24, 40))}.items()
    }


def test_chunked_prompts_with_preemption_generate_what_whole_prompts_do(tiny_model_dir, unchunked):
    engine = _engine(tiny_model_dir, 9, blocks=14)  # 14 blocks of 8: two requests growing preempt one
    got = _run(engine, _requests(3, 4, 0, (24, 40)))
    assert _run.preempted > 0, "nothing was preempted: the test would not cover it"
    assert got == unchunked["long"]
    assert engine.allocator.num_free == 14


def test_prefix_cache_hits_inside_chunked_prompts_stay_exact(tiny_model_dir, unchunked):
    engine = _engine(tiny_model_dir, 11)
    got = _run(engine, _requests(2, 4, 40))
    assert got == unchunked["shared"]
    assert sum(engine.prefix.hit_tokens.values()) > 0, "no request hit the cached prefix"


def test_migration_inside_a_chunked_prompt_resumes_exactly(tiny_model_dir, unchunked):
    """Every request is evicted at step 5 (several mid-prompt) and resubmitted with what it had."""
    mid_prompt = []

    def evict(engine, step):
        if step != 5:
            return []
        mid_prompt.extend(s for s in engine.scheduler.running if 0 < s.num_computed < len(s.prompt_ids))
        return engine.evict_all("test")

    got = _run(_engine(tiny_model_dir, 10), _requests(1), on_step=evict)
    assert mid_prompt, "no prompt was mid-way at the eviction"
    assert got == unchunked["plain"]
