"""Autoscaling and engine metrics on real Ray Serve (one local Ray cluster for the module):
ramp up then down, scale to zero and back, a scale-down that stops a replica still
streaming, no flapping under steady load, and the engine's series on Ray's Prometheus
endpoint.

The replicas run the simulated engine core (app/engine/simulated.py: the real scheduler,
a fixed 50 ms step instead of a model) because these tests need exact control of how
long a stream lasts, and three replicas on two cores. Requests go through a
DeploymentHandle (the deployment's consolidating router) and cluster.migration's
ResubmittingStream, as in the ingress; replicas are observed by polling each Serve replica
actor's routing stats.
"""
from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
import urllib.request
import uuid

import pytest

from app.config import parse_args
from app.engine.config import EngineConfig
from app.engine.simulated import StepTime, simulated_engine, simulated_token
from app.protocol import ErrorChunk, GenerateRequest, SamplingParams
from app.replica import LoraReplica, ReplicaSettings
from cluster.migration import MigrationPolicy, ResubmittingStream
from tests.app_fixtures import config_args, free_port, wait_for

BASE = "simulated"

STEP = StepTime(0.05)
FAST_METRICS = {"metrics_interval_s": 0.25, "look_back_period_s": 1.0}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    metrics_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()


_loop = asyncio.new_event_loop()
threading.Thread(target=_loop.run_forever, daemon=True).start()  # one client loop for every request


@pytest.fixture
def deploy(cluster):
    """deploy(name, autoscaling, max_batch) → the app name; deleted after the test."""
    from ray import serve

    names = []

    def _deploy(name: str, autoscaling: dict, max_batch: int = 2) -> str:
        args = config_args(max_batch_size=max_batch, adapter_dirs=[],
                           replica={"autoscaling_config": {**FAST_METRICS, **autoscaling},
                                    "ray_actor_options": {"num_cpus": 0.1}})
        options = parse_args(args, BASE).replica_options
        settings = ReplicaSettings(None, EngineConfig(max_num_seqs=max_batch, num_kv_blocks=512), (),
                                   migrate_locally=False)
        serve.run(LoraReplica.options(**options).bind(settings, None, functools.partial(simulated_engine, STEP)),
                  name=name, route_prefix=None)
        names.append(name)
        return name

    yield _deploy
    for name in names:
        serve.delete(name)


def complete(app: str, prompt: list[int], max_tokens: int) -> dict:
    """One request through the deployment's router and the ingress's migration path."""
    from ray import serve

    async def run():
        handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True)
        request = GenerateRequest(f"{app}-{uuid.uuid4().hex[:8]}", tuple(prompt),
                                  SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1))
        stream = await ResubmittingStream.open(lambda r: handle.generate.remote(r, None, 0), request,
                                               MigrationPolicy(max_migrations=4, failover_wait_s=30))
        text, tokens = "", 0
        async for chunk in stream.chunks():
            assert not isinstance(chunk, ErrorChunk), chunk
            text += chunk.text
            tokens += len(chunk.token_ids)
        return {"text": text, "completion_tokens": tokens, "moves": stream.moves}

    return asyncio.run_coroutine_threadsafe(run(), _loop).result(timeout=60)


def expected_text(prompt: list[int], max_tokens: int) -> str:
    return "".join(f" {simulated_token(tuple(prompt), i)}" for i in range(max_tokens))


def in_threads(fn, args_list) -> list:
    results = [None] * len(args_list)

    def run(i, args):
        results[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results


class Replicas:
    """Polls every LoraReplica replica actor of one app: samples[name] = [(t, stats)]."""

    def __init__(self, app: str, period_s: float = 0.2):
        self.app, self.period_s = app, period_s
        self.samples: dict[str, list[tuple[float, dict]]] = {}
        self.counts: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def names(self) -> list[str]:
        import ray

        prefix = f"SERVE_REPLICA::{self.app}#LoraReplica#"
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]

    def _loop(self):
        import ray

        while not self._stop.wait(self.period_s):
            alive = 0
            for name in self.names():
                try:
                    stats = ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=2)
                except Exception:  # stopping or not ready: not a live sample
                    continue
                if stats:
                    alive += 1
                    self.samples.setdefault(name, []).append((time.time(), stats))
            self.counts.append((time.time(), alive))

    def live(self) -> int:
        return self.counts[-1][1] if self.counts else 0

    def max_count(self) -> int:
        return max((n for _, n in self.counts), default=0)


def scrape(cluster) -> str:
    _, port = cluster
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def series_total(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_ramp_up_then_down_releases_the_idle_replicas(deploy):
    base = deploy("ramp", {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0.5, "downscale_delay_s": 3.0})
    with Replicas("ramp") as reps:
        wait_for(lambda: reps.live() == 1, timeout=20)
        prompts = [[5 + i, 7, 11] for i in range(6)]
        threads, results = in_threads(complete, [(base, p, 60) for p in prompts])  # 6 streams, batch 2 each
        assert wait_for(lambda: reps.live() == 3, timeout=40), reps.counts[-5:]
        for t in threads:
            t.join()
        assert [r["text"] for r in results] == [expected_text(p, 60) for p in prompts]
        # Load that fits one replica: one request at a time, which the router keeps on the oldest.
        deadline = time.time() + 40
        while reps.live() > 1 and time.time() < deadline:
            r = complete(base, [3, 1, 4], 10)
            assert r["text"] == expected_text([3, 1, 4], 10)
        assert reps.live() == 1, reps.counts[-5:]
    started = {name: s[0][1]["started_at"] for name, s in reps.samples.items()}
    survivor = next(name for name in reps.names())
    assert started[survivor] == min(started.values()), "the oldest replica stays"
    for name, samples in reps.samples.items():
        if name == survivor:
            continue
        last = samples[-1][0]
        before = [s for t, s in samples if t >= last - 2.5]  # within the idle delay before it stopped
        assert before and all(s["running"] == 0 and s["waiting"] == 0 for s in before), (name, before)


def test_scale_to_zero_and_back(deploy):
    base = deploy("zero", {"min_replicas": 0, "initial_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.5,
                           "downscale_delay_s": 2.0})
    with Replicas("zero") as reps:
        assert complete(base, [9, 9], 5)["text"] == expected_text([9, 9], 5)
        assert wait_for(lambda: reps.counts and reps.live() == 0 and not reps.names(), timeout=30), reps.counts[-5:]
        r = complete(base, [2, 7, 1], 8)  # waits at the handle while Serve starts a replica
        assert r["text"] == expected_text([2, 7, 1], 8)
        assert wait_for(lambda: reps.live() == 1, timeout=10)


def test_scale_down_of_a_replica_still_streaming_migrates_its_streams(deploy, cluster):
    # Two replicas; the two short requests fill the oldest (batch 2), the long one lands on the
    # newest. The oldest goes idle, the policy releases one replica, Ray stops the newest: the
    # long stream must move to the oldest and finish exactly as if it had never moved.
    base = deploy("drain", {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 2, "upscale_delay_s": 60.0,
                            "downscale_delay_s": 2.0})
    with Replicas("drain") as reps:
        assert wait_for(lambda: reps.live() == 2, timeout=20)
        shorts, results = in_threads(complete, [(base, [1, 2, 3], 20), (base, [4, 5, 6], 20)])
        time.sleep(0.3)
        long_prompt = [8, 6, 7, 5]
        longs, long_result = in_threads(complete, [(base, long_prompt, 200)])  # 10 s of steps
        for t in shorts + longs:
            t.join()
        assert reps.live() == 1
    assert [r["text"] for r in results] == [expected_text([1, 2, 3], 20), expected_text([4, 5, 6], 20)]
    out = long_result[0]
    assert out["text"] == expected_text(long_prompt, 200)
    assert out["completion_tokens"] == 200
    stopped = [n for n in reps.samples if n not in reps.names()]
    assert len(stopped) == 1 and any(s["running"] for _, s in reps.samples[stopped[0]]), "Ray stopped a busy replica"
    assert wait_for(lambda: series_total(scrape(cluster), "ray_loraplex_migrations_total") >= 1, timeout=20)


def test_no_flapping_under_steady_load(deploy):
    # 3 requests always in flight against a batch of 5: 60 % of one replica.
    base = deploy("steady", {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0},
                  max_batch=5)
    stop = time.time() + 12

    def closed_loop(i):
        n = 0
        while time.time() < stop:
            assert complete(base, [i, n], 12)["text"] == expected_text([i, n], 12)
            n += 1
        return n

    with Replicas("steady") as reps:
        wait_for(lambda: reps.live() == 1, timeout=20)
        threads, done = in_threads(closed_loop, [(i,) for i in range(3)])
        for t in threads:
            t.join()
    assert all(n >= 5 for n in done), done
    assert {n for _, n in reps.counts} == {1}, sorted(set(reps.counts))


def test_engine_and_autoscaler_metrics_on_the_prometheus_endpoint(deploy, cluster):
    base = deploy("metrics", {"min_replicas": 1, "max_replicas": 1, "downscale_delay_s": 30.0})
    for i in range(4):
        complete(base, [i + 1, 2, 3], 6)
    names = ["requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_total", "batch_size_bucket",
             "step_seconds_bucket", "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
             "prompt_tokens_total", "generation_tokens_total", "requests_finished_total", "requests_total"]

    def ready():
        text = scrape(cluster)
        return text if series_total(text, "ray_loraplex_engine_generation_tokens_total", application="metrics") >= 24 \
            else None

    text = wait_for(ready, timeout=30)
    assert text, "the engine's counters never reached the metrics endpoint"
    for n in names:
        assert f"ray_loraplex_engine_{n}" in text, n
    assert series_total(text, "ray_loraplex_engine_requests_total", application="metrics", adapter="base") == 4
    assert series_total(text, "ray_loraplex_engine_prompt_tokens_total", application="metrics") == 12
    assert series_total(text, "ray_loraplex_engine_time_to_first_token_seconds_count", application="metrics") == 4
    assert series_total(text, "ray_loraplex_engine_time_per_output_token_seconds_count", application="metrics") == 20
    for n in ["target_replicas", "replicas_idle"]:
        assert f"ray_loraplex_autoscaler_{n}" in text, n
