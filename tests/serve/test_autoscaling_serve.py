"""Autoscaling and engine metrics on real Ray Serve (one local Ray cluster for the module):
ramp up then down and to zero and back, an idle replica behind a busy newer one (Ray would
stop the busy one: nothing goes until it has emptied), no flapping under steady load, and the
engine's series on Ray's Prometheus endpoint. Each event is forced (streams held open until
the replica they wait for serves); the property asserted is that Serve released only idle
replicas: the routers of this process saw no release cut a request (cluster.leaving
busy_releases) and no stream moved.

Replicas run the simulated engine core (benchmarks/simulated_engine.py: the real scheduler, a
fixed 50 ms step instead of a model), so a stream's length is known and three replicas
fit two cores. Requests go through a DeploymentHandle (the deployment's consolidating
router) and app.openai.client_stream's ResubmittingStream, as in the ingress. Each request logs
the replicas that accepted it (the routing log); tests/support/replica_watch.py samples every
replica actor's stats.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from collections import Counter

import pytest

from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from benchmarks.simulated_engine import StepTime
from cluster.leaving import busy_releases
from tests.support.app_fixtures import delete_apps, shared_serve, wait_for
from tests.support.autoscaling_checks import complete, deploy, expected_text, in_threads, joined
from tests.support.replica_watch import ReplicaWatch


@pytest.fixture(scope="module")
def cluster():
    """The session's Ray with Serve (tests/support/app_fixtures.py); yields the Prometheus port of Ray's
    metrics agent. The module's applications are deleted at its end."""
    try:
        yield shared_serve()["metrics_port"]
    finally:
        delete_apps()


@pytest.fixture(scope="module")
def steady_app(cluster):
    """One replica of batch 5 that may scale to 3: shared by the flapping and metrics tests."""
    deploy("steady", {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0}, 5)
    return "steady"


def assert_released_idle(watch: ReplicaWatch, name: str, delay: float, routing_log: list) -> None:
    """Serve stopped ``name`` only after it had held nothing for ``delay``: every report it took
    (by its own clock, so a late answer is no false alarm) in the delay before it went shows it
    empty, and no request was accepted there in that window."""
    gone = watch.gone_at(name)
    assert gone is not None, name
    before = [s for s in watch.samples_since(name, 0.0) if gone - delay <= s["reported_at"] <= gone]
    assert all(s["running"] == s["waiting"] == s["held"] == 0 for s in before), (name, before)
    assert not [at for at, rid in routing_log if rid == name and at >= gone - delay], name


def first_token(gen) -> tuple[str, object]:
    """A stream's replica (its Accepted) and its next chunk: a token once that replica runs it."""
    accepted = next(gen)
    return accepted.replica_id, next(gen)


def test_ramp_up_then_down_to_zero_and_back(cluster):
    from ray import serve

    delay = 2.0
    deploy(
        "ramp",
        {
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 3,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": delay,
        },
        2,
        StepTime(0.1),  # a step of >= 0.1 s: the burst's streams outlast joined's wait (below)
    )
    cut = len(busy_releases())
    with ReplicaWatch("ramp") as watch:
        # up from zero: 6 streams wait for Serve to start replicas of batch 2 (so each gets work the
        # moment it runs, never idles first) and the deployment grows to 3. Each stream is as long as
        # the simulated context allows (4090 steps: longer than joined waits for the replicas to
        # start), so it is open until cancelled below; Serve gives a replica at most its batch
        handle = serve.get_deployment_handle("LoraReplica", "ramp").options(stream=True).generate
        params = SamplingParams(max_tokens=4090, temperature=0.0)
        burst = [handle.remote(GenerateRequest(f"burst-{i}", (5 + i, 7, 11), params), None, 0) for i in range(6)]
        readers = in_threads(first_token, [(gen,) for gen in burst])
        served = joined(*readers)  # waits on replica starts only (joined bounds it)
        assert all(isinstance(chunk, TokenChunk) for _, chunk in served), served
        routed_at = time.time()
        placed = Counter(rid for rid, _ in served)
        assert sorted(placed.values()) == [2, 2, 2], placed  # every replica full, none idle
        for gen in burst:
            gen.cancel()
        # no load: the three idle and go, newest first, down to zero
        assert wait_for(lambda: not watch.names(), timeout=120), watch.names()
        assert all(watch.gone_at(n) for n in placed)  # (Serve replaces a replica whose start fails)
        for name in placed:
            assert_released_idle(watch, name, delay, [(routed_at, rid) for rid in placed])
        # then a request waits for Serve to start a replica
        back = complete("ramp", [2, 7, 1], 8)
        assert back["text"] == expected_text([2, 7, 1], 8)
        assert back["routed"][0][1] not in placed  # a new replica served it
    assert back["moves"] == []  # no stream was cut
    assert busy_releases()[cut:] == []


def test_an_idle_replica_behind_a_busy_newer_one_stays_and_no_stream_moves(cluster):
    # Batch 2. Two streams held open fill the first replica; a third waits, and goes to a second
    # replica started for it. Then the two are closed: the first idles while the second streams.
    # Ray would stop the second, so nothing is released until it has emptied and idled.
    from ray import serve

    delay = 1.5
    deploy(
        "behind",
        {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": delay,
        },
        2,
    )
    cut = len(busy_releases())
    handle = serve.get_deployment_handle("LoraReplica", "behind").options(stream=True).generate
    with ReplicaWatch("behind") as watch:
        assert wait_for(lambda: len(watch.reporting()) == 1, timeout=60)
        (first,) = watch.names()
        held = []
        for i in range(2):  # 2000 steps: open until closed below
            request = GenerateRequest(f"held-{i}", (1, 2, 3 + i), SamplingParams(max_tokens=2000, temperature=0.0))
            held.append(handle.remote(request, None, 0))
            assert next(held[-1]).replica_id == first  # Accepted
        long_prompt = [8, 6, 7, 5]
        long_run = in_threads(complete, [("behind", long_prompt, 200)])
        assert wait_for(lambda: any(watch.latest(n).get("running") == 1 for n in watch.names() - {first}), timeout=300)
        for gen in held:
            gen.cancel()
        (long,) = joined(*long_run)
        assert wait_for(lambda: watch.names() == {first}, timeout=60), watch.names()
    (second,) = watch.ever() - {first}
    assert [rid for _, rid in long["routed"]] == [second] and long["moves"] == []
    assert long["text"] == expected_text(long_prompt, 200)
    # the first idled behind the busy second, and stayed: Serve stopped the second once it had idled
    assert watch.gone_at(first) is None
    assert_released_idle(watch, second, delay, long["routed"])
    assert busy_releases()[cut:] == []


def test_no_flapping_under_steady_load(steady_app):
    # 3 streams always in flight against a batch of 5: 60 % of one replica. Each is 30 steps
    # (1.5 s), so the gaps between one request and the next, longer on a busy machine, stay small
    stop = time.time() + 10

    def closed_loop(i):
        done = []
        while time.time() < stop:
            done.append(complete(steady_app, [i, len(done)], 30))
            assert done[-1]["text"] == expected_text([i, len(done) - 1], 30)
        return done

    with ReplicaWatch(steady_app) as watch:
        assert wait_for(lambda: len(watch.reporting()) == 1, timeout=30)
        (only,) = watch.names()
        done = joined(*in_threads(closed_loop, [(i,) for i in range(3)]))
        assert watch.ever() == {only}, watch.ever()  # no replica started or stopped meanwhile
        busy = [s["running"] for s in watch.samples_since(only, stop - 8, stop)]
        assert 2 <= sum(busy) / len(busy) <= 3, busy  # the load: 3 streams, less the gaps between requests
    assert all(len(d) >= 3 for d in done), [len(d) for d in done]  # a closed loop: one after another
    assert {rid for d in done for r in d for _, rid in r["routed"]} == {only}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def series(text: str, name: str, **labels) -> list[float]:
    """The values of every series of that name carrying those labels."""
    values = []
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            values.append(float(m.group(2)))
    return values


def series_total(text: str, name: str, **labels) -> float:
    return sum(series(text, name, **labels))


def test_engine_and_autoscaler_metrics_on_the_prometheus_endpoint(cluster, steady_app):
    probe = f"probe-{uuid.uuid4().hex[:6]}"  # an adapter name no other request used
    for i in range(4):
        assert complete(steady_app, [i + 1, 2, 3], 6, adapter=probe)["completion_tokens"] == 6

    def probed():
        text = scrape(cluster)
        return text if series_total(text, "ray_loraplex_engine_requests_total", adapter=probe) >= 4 else None

    text = wait_for(probed, timeout=30)
    assert text, "the engine's per-adapter counter never reached the metrics endpoint"
    assert series_total(text, "ray_loraplex_engine_requests_total", application=steady_app, adapter=probe) == 4
    for n in [
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "batch_size_bucket",
        "step_seconds_bucket",
        "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_bucket",
        "prompt_tokens_total",
        "generation_tokens_total",
        "requests_finished_total",
    ]:
        assert (
            series_total(text, f"ray_loraplex_engine_{n}", application=steady_app) > 0
            or f"ray_loraplex_engine_{n}" in text
        ), n
    assert series_total(text, "ray_loraplex_engine_generation_tokens_total", application=steady_app) >= 24
    assert series_total(text, "ray_loraplex_engine_time_to_first_token_seconds_count", application=steady_app) >= 4
    assert set(series(text, "ray_loraplex_engine_kv_blocks_total", application=steady_app)) == {512}  # per replica
    target = series(text, "ray_loraplex_autoscaler_target_replicas", application=steady_app, deployment="LoraReplica")
    assert target and target[-1] >= 1  # this app's own gauge: other apps on the cluster share the deployment name
    assert "ray_loraplex_autoscaler_replicas_idle" in text
