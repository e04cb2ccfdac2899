"""Helpers for the cluster tests: a tiny random Llama that speaks the embedded model's
tokenizer (real text, stop strings, chat template), engines slowed to a fixed step time,
LoraReplica deployed on its own (no ingress), and direct access to each replica."""

from __future__ import annotations

import time

from benchmarks.checkpoints import make_tiny_chat_llama  # noqa: F401  (the tests take it from here)

STEP_DELAY_S = 0.03  # the slowed engine's extra time per step: requests stay in flight long enough to observe


def slowed_engine(settings, delay_s: float = STEP_DELAY_S):
    """The real engine, each step delay_s slower (a GPU-sized step on a tiny CPU model)."""
    from app.serving.replica import build_async_engine

    engine = build_async_engine(settings)
    step = engine.core.step

    def slow_step():
        time.sleep(delay_s)
        return step()

    engine.core.step = slow_step
    return engine


def replica_ids(app: str) -> list[str]:
    """Ids of the LoraReplica actors alive now."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LoraReplica#"
    return sorted(
        a["name"][len(prefix) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if isinstance(a, dict) and a["name"].startswith(prefix)
    )


def replica_actor(app: str, replica_id: str):
    import ray

    return ray.get_actor(f"SERVE_REPLICA::{app}#LoraReplica#{replica_id}", namespace="serve")


def replica_report(app: str, replica_id: str):
    """The replica's routing stats, read from it directly (not the router's stale copy)."""
    import ray

    from cluster.stats import ReplicaStats

    return ReplicaStats.from_dict(ray.get(replica_actor(app, replica_id).record_routing_stats.remote(), timeout=30))


def deploy_replicas(app: str, args: dict, adapters: tuple, engine_factory) -> None:
    """LoraReplica alone (its router, no ingress or registry) with the app's `args`; its
    replica count can be changed in place by `scale` (Serve's external scaler API)."""
    from ray import serve

    from app.serving.config import parse_args
    from app.serving.replica import LoraReplica, ReplicaSettings

    settings = parse_args(args, "model")
    replica = LoraReplica.options(**settings.replica_options).bind(
        ReplicaSettings(settings.model, settings.engine, adapters, migrate_locally=False), None, engine_factory
    )
    serve.run(replica, name=app, route_prefix=None, external_scaler_enabled=True)


def scale(app: str, num_replicas: int) -> None:
    """Set the replica count as an autoscaler would: Serve picks which replicas stop."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID("LoraReplica", app), num_replicas))


def _request_router(app: str):
    """This process's request router for the app's LoraReplica (every handle of a deployment in
    a process shares one router): reaches into Serve's handle."""
    from ray import serve

    router = serve.get_deployment_handle("LoraReplica", app)._init_router()
    return router._asyncio_router.request_router  # created on first use


def router_order(app: str) -> list[str]:
    """Replica ids in the order the router ranks their age: Serve's running order, oldest first."""
    request_router = _request_router(app)
    order = getattr(request_router, "_order", {})
    return sorted(order, key=order.get)


def router_reports(app: str) -> dict:
    """{replica id: ReplicaStats} as this process's router for the app's LoraReplica last heard
    them (Serve's controller polls each replica and passes the reports on): what it routes on.
    Waiting on this, not on a fixed sleep, tells a test the router has caught up. Reaches into
    Serve's handle."""
    from cluster.stats import ReplicaStats

    request_router = _request_router(app)
    replicas = request_router.curr_replicas.items() if request_router is not None else ()
    return {rid.unique_id: ReplicaStats.from_dict(r.routing_stats) for rid, r in replicas if r.routing_stats}
