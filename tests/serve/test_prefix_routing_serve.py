"""A tenant's requests land on the replica where its prefix is warm, while that replica has room
(three replicas of a real deployment, the router's own reports)."""

import random

import pytest

from app.protocol import GenerateRequest, SamplingParams
from cluster.stats import HEAD_TOKENS, prefix_head

# -- real Ray Serve ---------------------------------------------------------------------

APP = "prefix"


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from app.serving.registry import scan
    from tests.support.app_fixtures import config_args, delete_apps, shared_serve
    from tests.support.cluster_fixtures import deploy_replicas, make_tiny_chat_llama, slowed_engine
    from tests.support.helpers import make_random_adapter

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

    from tests.support.app_fixtures import wait_for
    from tests.support.cluster_fixtures import replica_ids, replica_report, router_order, router_reports

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
