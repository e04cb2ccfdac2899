"""Prefix-affinity routing: the ranking rule without Ray, the heads an engine reports, and on
real Ray Serve (3 replicas) a tenant's requests landing where its prefix is warm while that
replica has room."""

import random

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from cluster.router import Policy, ReplicaView, key_of, rank
from cluster.routing_key import RoutingKey
from cluster.stats import HEAD_TOKENS, ReplicaStats, prefix_head
from tests.support.helpers import run_to_completion

POLICY = Policy(reserve_blocks=1, max_batch=4, block_size=16)
HEAD = prefix_head("t", tuple(range(HEAD_TOKENS)))


def stats(running=0, started=0.0, heads=()):
    return ReplicaStats(running, 0, 4, 100, 100, 16, (), False, started, 1.0, running, (), -4.0, tuple(heads))


def test_a_warm_prefix_breaks_ties_before_age_but_never_beats_a_busier_replica():
    views = [
        ReplicaView("old", stats(1, started=0)),
        ReplicaView("warm", stats(1, started=5, heads=[HEAD])),
        ReplicaView("cold", stats(1, started=1, heads=["other"])),
        ReplicaView("newest", stats(0, started=10)),  # a scale-down stops it first: fed last (cluster/router.py)
    ]
    assert rank(views, RoutingKey(40, adapter="t", head=HEAD), POLICY) == ["warm", "old", "cold", "newest"]
    assert rank(views, RoutingKey(40, adapter="t"), POLICY) == ["old", "cold", "warm", "newest"]  # no head: age decides
    busier = [ReplicaView("busy", stats(2, started=9)), *views]
    assert rank(busier, RoutingKey(40, adapter="t", head=HEAD), POLICY)[0] == "busy"  # consolidation first
    full = [ReplicaView("warm", stats(4, heads=[HEAD])), ReplicaView("old", stats(0))]
    assert rank(full, RoutingKey(40, adapter="t", head=HEAD), POLICY) == ["old"]  # no room: elsewhere


def test_the_head_names_adapter_and_first_tokens_only():
    prompt = tuple(range(HEAD_TOKENS + 5))
    assert prefix_head("t", prompt) == prefix_head("t", prompt[:HEAD_TOKENS] + (9, 9))
    assert prefix_head("t", prompt) != prefix_head("u", prompt) != prefix_head(None, prompt)
    assert prefix_head("t", prompt[: HEAD_TOKENS - 1]) is None

    class Pending:
        args = (GenerateRequest("x", prompt, adapter="t"),)

    assert key_of(Pending()).head == prefix_head("t", prompt)


def test_an_engine_reports_the_heads_it_admitted_most_recently(tiny_model_dir):
    engine = build_engine(tiny_model_dir, EngineConfig(num_kv_blocks=64, block_size=8), tokenizer=None)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(320) for _ in range(HEAD_TOKENS + 3)) for _ in range(3)]
    jobs = {i: [GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=2))] for i, p in enumerate(prompts)}
    run_to_completion(engine, {**jobs, 3: [GenerateRequest("short", (1, 2, 3), SamplingParams(max_tokens=2))]})
    assert engine.stats().prefix_heads == tuple(prefix_head(None, p) for p in prompts)
