"""A replica whose engine cannot start fails its deployment clearly: Serve's status carries the
engine's one-line cause, no AttributeError from the replica's teardown follows it, and Serve stops
retrying (DEPLOY_FAILED) even under the GPU config's autoscaling. The failing engine is injected:
it runs out of memory inside a start-up stage, as a KV cache too large for the GPU does."""

import functools
from pathlib import Path

from app.builder import app_from_args
from tests.support.app_fixtures import APP, config_args, delete_apps, shared_serve, wait_for
from tests.support.startup_fixtures import engine_out_of_memory

AUTOSCALING = {"min_replicas": 1, "max_replicas": 8, "upscale_delay_s": 2, "downscale_delay_s": 60}


def _status():
    from ray import serve

    app = serve.status().applications.get(APP)
    return app, (app.deployments.get("LoraReplica") if app else None)


def _session_logs() -> str:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    return "\n".join(
        p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".err", ".out")
    )


def test_a_replica_that_cannot_start_fails_the_deployment_with_its_cause(tmp_path):
    from ray import serve

    shared_serve()
    attempts = tmp_path / "attempts"
    factory = functools.partial(engine_out_of_memory, attempts=str(attempts))
    app = app_from_args(config_args(replica={"autoscaling_config": AUTOSCALING}), engine_factory=factory)
    try:
        serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")], wait_for_applications_running=False)
        failed = wait_for(lambda: _status()[0] is not None and _status()[0].status == "DEPLOY_FAILED", timeout=300)
        assert failed, _status()
        app_status, replica = _status()
        assert replica.status == "DEPLOY_FAILED"
        cause = "out of GPU memory allocating the KV cache and capturing the CUDA graphs on cpu (tried to allocate 64.00 GiB)"
        assert cause in replica.message and "lower num_kv_blocks (or set it to auto)" in replica.message
        assert "AttributeError" not in replica.message and "OutOfMemoryError" not in replica.message
        tried = attempts.read_text().count("attempt")
        assert 1 <= tried <= 3  # Serve's retries for one replica, not one per autoscaling decision
        assert "has no attribute 'metrics'" not in _session_logs()
    finally:
        delete_apps()
