"""Losing a worker node mid-stream loses no stream: a Ray cluster of a head and two
workers on this machine (`ray.cluster_utils.Cluster`), the proxy, Ingress and registry on
the head as the shipped config places them, one LoraReplica on each worker. With 8 greedy
streams running, the worker holding the replica that serves them is removed; every
stream ends with `[DONE]` and equals the same stream on the intact cluster, and a new
request right after succeeds."""

import functools

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from app.builder import app_from_args
from tests.support.app_fixtures import APP, config_args, free_port, release_shared, wait_for
from tests.support.cluster_fixtures import (
    make_tiny_chat_llama,
    replica_actor,
    replica_ids,
    replica_report,
    slowed_engine,
)
from tests.support.sse_client import errors, finish, start_streams

STREAMS = 8
MAX_TOKENS = 120
PROMPTS = [f"Chapter {i}: the ship left port" for i in range(STREAMS)]
SLOT = "replica_slot"  # a resource only the workers have: the replicas go there


def _bodies():
    return [{"model": "model", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_chat_llama(tmp_path_factory.mktemp("node-loss") / "model")
    release_shared()  # a cluster of nodes of its own, not the session's one-node Ray
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        args = config_args(
            model=str(model),
            max_model_len=256,
            adapter_dirs=[],
            max_batch_size=STREAMS,
            replica={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0, "resources": {SLOT: 1}}},
            cluster={"failover_wait_s": 120},
        )
        serve.run(
            app_from_args(args, engine_factory=functools.partial(slowed_engine, delay_s=0.1)),
            name=APP,
            route_prefix="/",
        )
        yield {"cluster": cluster, "workers": workers, "url": f"http://127.0.0.1:{port}"}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _node_of(replica_id):
    return ray.get(
        replica_actor(APP, replica_id).__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
        timeout=60,
    )


def test_a_worker_lost_mid_stream_loses_no_stream(cluster):
    url = cluster["url"]
    references = finish(*start_streams(url, _bodies()))
    assert all(r["events"][-1:] == ["[DONE]"] and not errors(r) for r in references)

    threads, results = start_streams(url, _bodies())
    assert all(r["started"].wait(300) for r in results)
    busy = wait_for(lambda: [rid for rid in replica_ids(APP) if replica_report(APP, rid).running > 0], timeout=60)
    assert busy, "no replica is running the streams"
    node = _node_of(busy[0])
    worker = next(w for w in cluster["workers"] if w.node_id == node)  # never the head: replicas need SLOT
    cluster["cluster"].remove_node(worker)

    for r, ref in zip(finish(threads, results), references):
        assert r["events"][-1:] == ["[DONE]"] and not errors(r), r["events"][-3:]
        assert r["text"] == ref["text"]
    fresh = httpx.post(
        f"{url}/v1/completions", json={"model": "model", "prompt": "Hello", "max_tokens": 4}, timeout=300
    )
    assert fresh.status_code == 200, fresh.text
