"""Autoscaling and engine metrics on real Ray Serve (one local Ray cluster for the module):
ramp up then down and to zero and back, a scale-down that stops a replica still
streaming, no flapping under steady load, and the engine's series on Ray's Prometheus
endpoint.

Replicas run the simulated engine core (tests/simulated_engine.py: the real scheduler, a
fixed 50 ms step instead of a model), so a stream's length is known and three replicas
fit two cores. Requests go through a DeploymentHandle (the deployment's consolidating
router) and app.openai.client_stream's ResubmittingStream, as in the ingress. Each request logs
the replicas that accepted it (the routing log); tests/replica_watch.py samples every
replica actor's stats.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid

import pytest

from tests.app_fixtures import delete_apps, shared_serve, wait_for
from tests.autoscaling_checks import complete, deploy, expected_text, in_threads, joined
from tests.cluster_fixtures import router_reports
from tests.replica_watch import ReplicaWatch


@pytest.fixture(scope="module")
def cluster():
    """The session's Ray with Serve (tests/app_fixtures.py); yields the Prometheus port of Ray's
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


def _router_idle(app: str) -> bool:
    """Every replica in the router's copy of the reports is empty (one being stopped drops out)."""
    reports = router_reports(app)
    return bool(reports) and all(r.batch == 0 for r in reports.values())


def test_ramp_up_then_down_to_zero_and_back(cluster):
    delay = 2.0
    # busy_newer_wait_s: an idle replica never makes Ray stop a busy one here (the next test does)
    deploy(
        "ramp",
        {
            "min_replicas": 0,
            "initial_replicas": 1,
            "max_replicas": 3,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": delay,
            "busy_newer_wait_s": 60.0,
        },
        2,
    )
    with ReplicaWatch("ramp") as watch:
        assert wait_for(lambda: len(watch.reporting()) == 1, timeout=30)
        # 6 streams of 7.5 s against one replica of batch 2: they wait for room, the deployment grows
        prompts = [[5 + i, 7, 11] for i in range(6)]
        burst = joined(*in_threads(complete, [("ramp", p, 150) for p in prompts]))
        assert [r["text"] for r in burst] == [expected_text(p, 150) for p in prompts]
        assert watch.most_at_once() == 3
        assert len({rid for r in burst for _, rid in r["routed"]}) >= 2
        # load that fits one replica, once every replica has reported its batch empty: the router
        # keeps it on the oldest, and the newer ones go as soon as they have idled for the delay
        assert wait_for(watch.all_idle, timeout=60)
        # the router's copy of the reports (polled every 0.5 s) shows them empty too: a deadline, no sleep
        assert wait_for(lambda: _router_idle("ramp"), timeout=60)
        oldest, low_start, low = watch.oldest(), time.time(), []
        while len(watch.names()) > 1 and time.time() < low_start + 30:
            low.append(complete("ramp", [3, 1, len(low)], 10))
            assert low[-1]["text"] == expected_text([3, 1, len(low) - 1], 10)
        # the load ended on the oldest alone; which replica took a request before the router's next
        # stats poll depends on the machine's load, so the property checked is the release below
        assert watch.names() == {oldest}, watch.names()
        assert low[-1]["routed"][-1][1] == oldest
        routing_log = [(at, rid) for r in burst + low for at, rid in r["routed"]]
        released = watch.ever() - {oldest}
        assert len(released) == 2
        for name in released:  # at batch 0, and sent nothing, for the delay before Serve stopped it
            gone = watch.gone_at(name)
            # on a loaded machine a stopping replica may answer no poll in that window: then its
            # last answer before it went is what it last reported
            before = watch.samples_since(name, gone - delay, gone) or watch.samples_since(name, 0.0, gone)[-1:]
            assert before and all(s["running"] == s["waiting"] == 0 for s in before), (name, before)
            assert not [at for at, rid in routing_log if rid == name and at >= gone - delay], name
        # no load: down to zero, then a request waits for Serve to start a replica
        assert wait_for(lambda: not watch.names(), timeout=30), watch.names()
        back = complete("ramp", [2, 7, 1], 8)
        assert back["text"] == expected_text([2, 7, 1], 8)
        assert back["routed"][0][1] not in released | {oldest}  # a new replica served it


def test_scale_down_of_a_replica_still_streaming_migrates_its_streams(cluster):
    # Batch 2. Two short streams fill the first replica; a long one waits, and goes to a second
    # replica started for it. The first empties and idles; Ray would stop the second, so the
    # policy gives it busy_newer_wait_s to empty, then releases one replica anyway: Ray stops
    # the second, and its stream moves to the first.
    deploy(
        "drain",
        {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 1.5,
            "busy_newer_wait_s": 1.0,
        },
        2,
    )
    with ReplicaWatch("drain") as watch:
        assert wait_for(lambda: len(watch.reporting()) == 1, timeout=30)
        (first,) = watch.names()
        short_prompts = [[1, 2, 3], [4, 5, 6]]
        shorts = in_threads(complete, [("drain", p, 200) for p in short_prompts])  # 10 s: a replica starts
        assert wait_for(lambda: watch.latest(first).get("running") == 2, timeout=10)
        long_prompt = [8, 6, 7, 5]
        (long,) = joined(*in_threads(complete, [("drain", long_prompt, 300)]))
        assert [r["text"] for r in joined(*shorts)] == [expected_text(p, 200) for p in short_prompts]
        assert watch.names() == {first}
    assert {rid for r in joined(*shorts) for _, rid in r["routed"]} == {first}
    (second,) = watch.ever() - {first}
    assert [rid for _, rid in long["routed"]] == [second, first], long["routed"]
    assert [reason for reason, _ in long["moves"]] == ["replica_stopped"]
    assert 0 < long["moves"][0][1] < 300  # it moved mid-stream
    assert any(s["running"] == 1 for s in watch.samples_since(second, 0)), "Ray stopped the replica streaming"
    assert long["text"] == expected_text(long_prompt, 300) and long["completion_tokens"] == 300


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
