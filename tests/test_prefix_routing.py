"""Prefix-affinity routing: the ranking rule without Ray, the heads an engine reports, and on
real Ray Serve (3 replicas) a tenant's requests landing where its prefix is warm while that
replica has room."""

import random

import pytest

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from cluster.router import Need, Policy, ReplicaView, need_of, rank
from cluster.stats import HEAD_TOKENS, ReplicaStats, prefix_head
from tests.helpers import run_to_completion

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
    assert rank(views, Need(40, adapter="t", head=HEAD), POLICY) == ["warm", "old", "cold", "newest"]
    assert rank(views, Need(40, adapter="t"), POLICY) == ["old", "cold", "warm", "newest"]  # no head: age decides
    busier = [ReplicaView("busy", stats(2, started=9)), *views]
    assert rank(busier, Need(40, adapter="t", head=HEAD), POLICY)[0] == "busy"  # consolidation first
    full = [ReplicaView("warm", stats(4, heads=[HEAD])), ReplicaView("old", stats(0))]
    assert rank(full, Need(40, adapter="t", head=HEAD), POLICY) == ["old"]  # no room: elsewhere


def test_the_head_names_adapter_and_first_tokens_only():
    prompt = tuple(range(HEAD_TOKENS + 5))
    assert prefix_head("t", prompt) == prefix_head("t", prompt[:HEAD_TOKENS] + (9, 9))
    assert prefix_head("t", prompt) != prefix_head("u", prompt) != prefix_head(None, prompt)
    assert prefix_head("t", prompt[: HEAD_TOKENS - 1]) is None

    class Pending:
        args = (GenerateRequest("x", prompt, adapter="t"),)

    assert need_of(Pending(), POLICY).head == prefix_head("t", prompt)


def test_an_engine_reports_the_heads_it_admitted_most_recently(tiny_model_dir):
    engine = build_engine(tiny_model_dir, EngineConfig(num_kv_blocks=64, block_size=8), tokenizer=None)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(320) for _ in range(HEAD_TOKENS + 3)) for _ in range(3)]
    jobs = {i: [GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=2))] for i, p in enumerate(prompts)}
    run_to_completion(engine, {**jobs, 3: [GenerateRequest("short", (1, 2, 3), SamplingParams(max_tokens=2))]})
    assert engine.stats().prefix_heads == tuple(prefix_head(None, p) for p in prompts)


# -- real Ray Serve ---------------------------------------------------------------------

APP = "prefix"


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from app.serving.registry import scan
    from tests.app_fixtures import config_args, delete_apps, shared_serve
    from tests.cluster_fixtures import deploy_replicas, make_tiny_chat_llama, slowed_engine
    from tests.helpers import make_random_adapter

    root = tmp_path_factory.mktemp("prefix-cluster")
    model = make_tiny_chat_llama(root / "model")
    make_random_adapter(model, root / "adapters" / "t", rank=4, targets=["q_proj", "v_proj"], seed=3)
    specs = {s.name: s for s in scan([root / "adapters"])}
    args = config_args(
        model=str(model),
        max_batch_size=4,
        num_kv_blocks=64,
        block_size=16,
        max_model_len=256,
        max_tokens_per_step=256,
        adapter_dirs=[str(root / "adapters")],
        max_loras=2,
        max_lora_rank=8,
        replica={"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}},
        ingress={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        cluster={"routing_stats_period_s": 0.2, "failover_wait_s": 60, "max_migrations": 32},
    )
    shared_serve()  # the session's Ray + Serve
    try:
        deploy_replicas(APP, args, tuple(specs.values()), slowed_engine)
        yield specs
    finally:
        delete_apps()


def test_a_tenant_lands_where_its_prefix_is_warm_while_that_replica_has_room(pack):
    import ray
    from ray import serve

    from tests.app_fixtures import wait_for
    from tests.cluster_fixtures import replica_ids, replica_report, router_order, router_reports

    handle = serve.get_deployment_handle("LoraReplica", APP).options(stream=True).generate
    assert wait_for(lambda: sorted(router_order(APP)) == replica_ids(APP), timeout=60)
    order = router_order(APP)  # Serve's running order, oldest first: the age the router ranks by
    rng = random.Random(7)
    tenant, stranger = (tuple(rng.randrange(100, 49000) for _ in range(HEAD_TOKENS + 8)) for _ in range(2))
    count = iter(range(100))

    def open_stream(system, max_tokens=3, avoid=()):
        request = GenerateRequest(
            f"p{next(count)}",
            system + (rng.randrange(100, 49000),),
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            "t",
            avoid_replicas=avoid,
        )
        gen = handle.remote(request, pack["t"], 0)
        replica = next(gen).replica_id  # Accepted: where the router sent it
        next(gen)  # its first token: it runs
        return replica, gen

    def run(system, avoid=()):
        replica, gen = open_stream(system, avoid=avoid)
        list(gen)
        return replica

    def settled(replica=None):
        """Every replica idle (and ``replica`` reporting the tenant's head), in its own report and
        in the router's copy of it (polled every 0.2 s): the router routes on what they say."""

        def fits(reports):
            return all(r in reports and reports[r].batch == 0 for r in order) and (
                replica is None or prefix_head("t", tenant) in reports[replica].prefix_heads
            )

        def check():
            try:
                return fits({r: replica_report(APP, r) for r in order}) and fits(router_reports(APP))
            except ray.exceptions.RayError:  # a replica still busy with cancelled streams
                return False

        assert wait_for(check, timeout=90)

    settled()  # the router has every replica's first report
    assert run(stranger) == order[0]  # all idle: the oldest
    settled()
    assert run(tenant, avoid=(order[0],)) == order[1]  # warm the tenant's prefix on the middle replica
    settled(order[1])
    assert [run(tenant) for _ in range(3)] == [order[1]] * 3  # idle ties go to the warm replica, not the oldest
    settled(order[1])
    streams = [open_stream(tenant, max_tokens=60) for _ in range(5)]
    assert [r for r, _ in streams] == [order[1]] * 4 + [order[0]]  # full at 4: the oldest takes the fifth
    for _, gen in streams:
        gen.cancel()
    settled()
