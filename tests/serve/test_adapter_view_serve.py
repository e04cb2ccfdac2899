"""Adapter names resolve in each Ingress, over Serve: two Ingress replicas, the real registry
behind a gate (a named actor) that can hold every call to it, and the simulated engine
(benchmarks/simulated_engine.py) in one LoraReplica. With the registry held, requests for known
adapters complete (and an unknown name still gets its 404); once it answers again, an
adapter registered through the admin route is served by the very next requests, and after
its removal the next requests get the 404."""

import shutil

import httpx
import pytest

from app.serving.registry import AdapterRegistry
from tests.support.app_fixtures import APP, config_args, example_adapter_names, serving, wait_for
from tests.support.registry_gate import GATE, Gate, GatedRegistry

ADMIN_KEY = "sk-test-admin"
ADAPTERS = example_adapter_names()

pytestmark = pytest.mark.skipif(not ADAPTERS, reason="needs the example adapters in examples/adapters/")


def _app(tmp_root):
    from functools import partial

    from app.model.default import DEFAULT_MODEL_NAME
    from app.openai.ingress import Ingress
    from app.serving.config import parse_args
    from app.serving.registry import scan
    from app.serving.replica import LoraReplica, ReplicaSettings
    from benchmarks.simulated_engine import StepTime, simulated_engine

    args = config_args(
        admin_key=ADMIN_KEY,
        num_kv_blocks=256,
        adapter_roots=[str(tmp_root)],
        ingress={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
        replica={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
    )
    settings = parse_args(args, DEFAULT_MODEL_NAME)
    adapters = tuple(scan(settings.adapter_dirs))
    registry = AdapterRegistry.options(func_or_class=GatedRegistry).bind(list(adapters))
    replica = LoraReplica.options(**settings.replica_options).bind(
        ReplicaSettings(settings.model, settings.engine, adapters, True, settings.adapter_store),
        registry,
        partial(simulated_engine, StepTime(0.002)),
    )
    return Ingress.options(**settings.ingress_options).bind(settings, replica, registry)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    import ray

    from tests.support.app_fixtures import shared_serve

    root = tmp_path_factory.mktemp("registered")
    shared_serve()  # the gate lives on the session's Ray, beside the app
    gate = ray.remote(num_cpus=0)(Gate).options(name=GATE[0], namespace=GATE[1]).remote()
    try:
        with serving({APP: (_app(root), "/")}) as url:
            yield url, gate, root
    finally:
        ray.get(gate.open.remote())
        ray.kill(gate)


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": [5, 7, 11], "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_names_resolve_while_the_registry_is_held_and_admin_changes_are_seen_at_once(gated):
    import ray

    url, gate, root = gated
    known = ADAPTERS[0]
    assert _complete(url, known).status_code == 200
    unknown = _complete(url, "no-such-adapter")
    assert unknown.status_code == 404

    ray.get(gate.close.remote())
    try:
        # both Ingress copies' next polls wait at the gate (a bound, not a timing: they poll every few seconds)
        assert wait_for(lambda: ray.get(gate.holding.remote()) >= 2, timeout=60)
        answers = [_complete(url, known) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, answers[0].text
        assert all(a.json()["choices"][0]["text"] for a in answers)
        again = _complete(url, "no-such-adapter")
        assert (again.status_code, again.json()) == (404, unknown.json())
        assert ray.get(gate.holding.remote()) >= 2  # the registry was held throughout
    finally:
        ray.get(gate.open.remote())

    from app.generate import EXAMPLE_ADAPTERS

    copy = shutil.copytree(EXAMPLE_ADAPTERS / known, root / "copy")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    registered = httpx.post(f"{url}/v1/adapters", json={"name": "copy", "path": str(copy)}, headers=admin, timeout=60)
    assert registered.status_code == 200, registered.text
    assert [_complete(url, "copy").status_code for _ in range(6)] == [200] * 6

    assert httpx.delete(f"{url}/v1/adapters/copy", headers=admin, timeout=60).status_code == 200
    gone = [_complete(url, "copy") for _ in range(6)]
    assert [g.status_code for g in gone] == [404] * 6
    assert gone[0].json()["error"]["code"] == unknown.json()["error"]["code"]
