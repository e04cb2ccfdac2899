"""Driving the autoscaling tests' deployments: deploy one on the simulated engine core, run a
request through its router and the ingress's migration path, many at once in threads."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid

from app.engine.config import EngineConfig
from app.openai.client_stream import MigrationPolicy, ResubmittingStream
from app.protocol import ErrorChunk, GenerateRequest, SamplingParams
from app.serving.config import parse_args
from app.serving.replica import LoraReplica, ReplicaSettings
from benchmarks.simulated_engine import StepTime, simulated_engine, simulated_token
from tests.support.app_fixtures import config_args
from tests.support.cluster_checks import live_streams

STEP = StepTime(0.05)
FAST_METRICS = {"metrics_interval_s": 0.25, "look_back_period_s": 1.0}

_loop = asyncio.new_event_loop()
threading.Thread(target=_loop.run_forever, daemon=True).start()  # one client loop for every request


def deploy(app: str, autoscaling: dict, max_batch: int, step: StepTime = STEP) -> None:
    from ray import serve

    # max_ongoing_requests = the batch: Serve's own limit backs the router's count, so a
    # replica never holds more than it batches (the app's default allows 4 batches)
    args = config_args(
        max_batch_size=max_batch,
        adapter_dirs=[],
        replica={
            "autoscaling_config": {**FAST_METRICS, **autoscaling},
            "max_ongoing_requests": max_batch,
            "ray_actor_options": {"num_cpus": 0.1},
        },
    )
    options = parse_args(args, "simulated").replica_options
    settings = ReplicaSettings(None, EngineConfig(max_num_seqs=max_batch, num_kv_blocks=512), (), migrate_locally=False)
    serve.run(
        LoraReplica.options(**options).bind(settings, None, functools.partial(simulated_engine, step)),
        name=app,
        route_prefix=None,
    )


def complete(app: str, prompt: list[int], max_tokens: int, adapter: str | None = None) -> dict:
    """One request through the deployment's router and the ingress's migration path: its
    text, tokens, moves and routing log [(time accepted, replica id)]."""
    from ray import serve

    async def run():
        handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True)
        request = GenerateRequest(
            f"{app}-{uuid.uuid4().hex[:8]}",
            tuple(prompt),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1),
            adapter,
        )
        stream = await ResubmittingStream.open(
            lambda r: handle.generate.remote(r, None, 0),
            request,
            MigrationPolicy(max_migrations=4, failover_wait_s=30),
            live_streams(),
        )
        text, tokens, routed = "", 0, [(time.time(), stream.replica)]
        async for chunk in stream.chunks():
            assert not isinstance(chunk, ErrorChunk), chunk
            if stream.replica != routed[-1][1]:
                routed.append((time.time(), stream.replica))
            text += chunk.text
            tokens += len(chunk.token_ids)
        return {"text": text, "completion_tokens": tokens, "moves": stream.moves, "routed": routed}

    # a request may wait for Serve to start a replica: minutes on a 2-core machine under a CPU hog
    return asyncio.run_coroutine_threadsafe(run(), _loop).result(timeout=300)


def expected_text(prompt: list[int], max_tokens: int) -> str:
    return "".join(f" {simulated_token(tuple(prompt), i)}" for i in range(max_tokens))


def in_threads(fn, args_list) -> tuple[list[threading.Thread], list]:
    results = [None] * len(args_list)

    def run(i, args):
        results[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, a), daemon=True) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results


def joined(threads, results) -> list:
    for t in threads:
        t.join(timeout=330)
    assert all(r is not None for r in results), "a request did not complete"
    return results
