"""The replica's autoscaling report (LoraReplica.record_autoscaling_stats): a request the replica
accepted keeps it busy even before the request reaches the engine (the registry sync or its
adapter's load), so the policy never releases a replica with a request inside."""

import asyncio
from concurrent.futures import Future

from app.engine.engine_stats import EngineReport, EngineStats
from app.serving.replica import LoraReplica


class _EmptyEngine:
    """An engine holding nothing, idle since t = 100."""

    idle_since = 100.0

    def stats(self) -> Future:
        done = Future()
        done.set_result(
            EngineReport(EngineStats(running=0, waiting=0, max_batch=4, free_kv_blocks=8, total_kv_blocks=8))
        )
        return done


def _report(held: int) -> dict:
    replica = object.__new__(LoraReplica.func_or_class)  # the deployment's class, without Serve's start
    replica.engine, replica.held, replica.draining, replica.started_at = _EmptyEngine(), held, False, 1.0
    return asyncio.run(replica.record_autoscaling_stats())


def test_a_request_accepted_but_not_yet_in_the_engine_keeps_the_replica_busy():
    assert _report(held=1)["idle_since"] == 0.0  # busy: the policy's idle time is 0
    assert _report(held=1)["running"] == 0  # (the engine has not seen it)


def test_with_nothing_held_the_engine_says_since_when_it_is_idle():
    assert _report(held=0)["idle_since"] == 100.0
