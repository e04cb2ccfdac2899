"""No stream lost on a config change: `serve run` of a config with 3 LoraReplicas, 8 long
streams in flight, then `serve deploy` (the CLI, against the running cluster) of a config
whose `args` differ (Serve replaces every replica: Ingress, LoraReplicas, registry) and of
one whose replica count differs (a light update: 3 → 2, the stopped replica's streams
move). Every stream ends with `[DONE]` and equals its reference, the same greedy request run
alone on an engine in this process (the engines compute in float64); a fresh request sent
during each change succeeds."""

import os
import re
import shutil
import signal
import subprocess

import httpx
import pytest
import yaml

from tests.support.app_fixtures import CONFIG, FRESH_RAY, REPO, free_port, release_shared, wait_for
from tests.support.cluster_fixtures import make_tiny_chat_llama
from tests.support.sse_client import errors, finish, start_streams

pytestmark = pytest.mark.serve  # starts the `serve` CLI in a subprocess

STREAMS = 8
MAX_TOKENS = 240  # the tiny model's context is 256
PROMPTS = [f"Story {i}: once upon a time" for i in range(STREAMS)]


def _config(path, model, port, replicas: int, max_body_bytes: int):
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["import_path"] = "tests.support.fault_app:build_app"
    app["args"].update(
        model=str(model),
        dtype="float64",  # references are taken alone (tests: references)
        max_model_len=256,
        adapter_dirs=[],
        registry_path=None,
        max_body_bytes=max_body_bytes,
        max_batch_size=STREAMS,
        replica={"ray_actor_options": {"num_cpus": 0}},
    )
    app["deployments"] = [{"name": "LoraReplica", "num_replicas": replicas}, {"name": "Ingress", "num_replicas": 1}]
    path.write_text(yaml.safe_dump(config))
    return path


def _bodies():
    return [{"model": "model", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]


def _deploy(path, dashboard: str):
    done = subprocess.run(
        ["serve", "deploy", str(path), "-a", dashboard],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _env():
    env = os.environ | FRESH_RAY
    # a local cluster of this test's own: the CLI reaches its dashboard without a token
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    assert shutil.which("serve")
    release_shared()  # `serve run` starts a Ray of its own: the session's one would only take CPU
    root = tmp_path_factory.mktemp("config-change")
    model = make_tiny_chat_llama(root / "model")
    port = free_port()
    first = _config(root / "first.yaml", model, port, replicas=3, max_body_bytes=1 << 22)
    log = root / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["serve", "run", str(first)],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert wait_for(healthy, timeout=600, interval=1) and proc.poll() is None, log.read_text()[-5000:]
        # this cluster's own dashboard (other Ray clusters on the machine may hold the default port)
        dashboard = re.search(r"dashboard at \S*?(http://[\w.]+:\d+)", re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()))
        assert dashboard, log.read_text()[-5000:]
        yield {"url": url, "root": root, "model": model, "port": port, "dashboard": dashboard.group(1)}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def references(served):
    """Each stream alone on an engine in this process (same checkpoint, float64 like the served
    ones: a batch's shape moves no greedy choice then), not slowed: ~50 s of served steps saved."""
    import torch

    from app.engine.config import EngineConfig
    from app.engine.factory import build_engine
    from app.protocol import GenerateRequest, SamplingParams, TokenChunk

    core = build_engine(served["model"], EngineConfig(max_model_len=256, dtype=torch.float64))
    texts = []
    for i, prompt in enumerate(PROMPTS):
        ids = core.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # as the Ingress does
        core.add(GenerateRequest(f"ref{i}", tuple(ids), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)))
        chunks = []
        while core.has_work():
            chunks += [c for c in core.step() if isinstance(c, TokenChunk)]
        texts.append("".join(c.text for c in chunks))
    return texts


@pytest.mark.parametrize("change", ["args", "replicas"])
def test_streams_survive_a_serve_deploy(served, references, change):
    url, root = served["url"], served["root"]
    changed = (
        _config(root / "args.yaml", served["model"], served["port"], replicas=3, max_body_bytes=1 << 21)
        if change == "args"
        else _config(root / "replicas.yaml", served["model"], served["port"], replicas=2, max_body_bytes=1 << 21)
    )
    threads, results = start_streams(url, _bodies())
    assert all(r["started"].wait(300) for r in results), "a stream never started"
    _deploy(changed, served["dashboard"])
    fresh = httpx.post(
        f"{url}/v1/completions", json={"model": "model", "prompt": "Hello", "max_tokens": 4}, timeout=600
    )  # sent while Serve applies the change
    assert fresh.status_code == 200, fresh.text
    for r, expected in zip(finish(threads, results), references):
        assert r["events"][-1:] == ["[DONE]"] and not errors(r), r["events"][-3:]
        assert r["text"] == expected
