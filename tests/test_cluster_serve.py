"""The cluster layer on real Ray Serve: consolidation onto the oldest replicas
(3 replicas of a tiny Llama, max batch 4), asserted from the replicas' own
acceptances and stats, not from timing."""
import time

import pytest

from app.builder import app_from_args
from app.protocol import GenerateRequest, SamplingParams
from tests.app_fixtures import config_args, serving, wait_for
from tests.cluster_fixtures import make_tiny_chat_llama, replica_ids, replica_report, slowed_engine
from tests.helpers import make_random_adapter

ADAPTERS = ("a1", "a2")
# app → (num_replicas, block_size, num_kv_blocks, slowed)
APPS = {"pack": (3, 16, 64, True)}


def _args(model, adapters, replicas, block, blocks):
    return config_args(
        model=str(model), max_batch_size=4, num_kv_blocks=blocks, block_size=block, max_model_len=256,
        max_tokens_per_step=256, adapter_dirs=[str(adapters)], max_loras=4, max_lora_rank=8,
        replica={"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0.5}},
        ingress={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        cluster={"routing_stats_period_s": 0.2, "failover_wait_s": 60, "max_migrations": 16})


def _app(name, model, adapters, replicas=None):
    n, block, blocks, slowed = APPS[name]
    factory = {"engine_factory": slowed_engine} if slowed else {}
    return app_from_args(_args(model, adapters, replicas or n, block, blocks), **factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    model = make_tiny_chat_llama(root / "model")
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        make_random_adapter(model, adapters / name, rank=4 * (i + 1), targets=["q_proj", "v_proj", "down_proj"], seed=i)
    apps = {name: (_app(name, model, adapters), f"/{name}") for name in APPS}
    with serving(apps, num_cpus=8) as url:
        yield {"url": url, "model": model, "adapters": adapters}


def _idle(app):
    """Every replica: nothing running or waiting, every KV block free."""
    def check():
        reports = [replica_report(app, r) for r in replica_ids(app)]
        return all(s.batch == 0 and s.free_kv_blocks == s.total_kv_blocks for s in reports) and reports
    return wait_for(check, timeout=30)


# -- consolidation ---------------------------------------------------------------

def test_requests_fill_the_oldest_replica_first_and_an_emptied_replica_stays_empty(cluster):
    from ray import serve

    handle = serve.get_deployment_handle("LoraReplica", "pack").options(stream=True).generate
    ids = replica_ids("pack")
    order = sorted(ids, key=lambda r: replica_report("pack", r).started_at)  # oldest first
    streams, placed = [], []

    def open_one(i):
        request = GenerateRequest(f"c{i}", (101, 202, 303 + i), SamplingParams(max_tokens=240, temperature=0.0))
        gen = handle.remote(request, None, 0)
        accepted = next(gen)
        next(gen)  # its first token: it runs, so the next report counts it
        streams.append(gen)
        placed.append(accepted.replica_id)

    for i in range(12):
        open_one(i)
    assert placed == [order[0]] * 4 + [order[1]] * 4 + [order[2]] * 4
    assert [replica_report("pack", r).running for r in order] == [4, 4, 4]

    # load drops: the newest replica empties completely, the oldest keeps 2
    for gen in streams[8:12] + streams[0:2]:
        gen.cancel()
    assert wait_for(lambda: [replica_report("pack", r).batch for r in order] == [2, 4, 0], timeout=20)
    time.sleep(0.6)  # the router's copy of the stats is up to one period old
    for i in range(12, 14):
        open_one(i)
    assert placed[12:] == [order[0]] * 2  # the busiest with room, not the empty one
    assert replica_report("pack", order[2]).batch == 0
    for gen in streams:
        gen.cancel()
    assert _idle("pack")
