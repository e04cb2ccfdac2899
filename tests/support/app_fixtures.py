"""Helpers for the serving-app tests: start local Ray + Serve with the project's own
serve_config.yaml args on a free loopback port, and read replica stats."""

from __future__ import annotations

import copy
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "serve_config.yaml"
APP = "loraplex"
# Ray's usage-stats reporter would try to reach the internet: tests talk to loopback only.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def config_args(**overrides) -> dict:
    """The `args:` of serve_config.yaml's application, with overrides on top; runtime
    registrations in memory unless `registry_path` is given (the shipped file is the user's)."""
    config = yaml.safe_load(CONFIG.read_text())
    args = copy.deepcopy(config["applications"][0]["args"])
    if overrides.get("model") is not None:  # the shipped template and parser are the embedded model's
        args.pop("chat_template", None)
        args.pop("tool_parser", None)
    return {**args, "registry_path": None, **overrides}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(url: str) -> bool:
    """The app answers GET /health with 200."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# A Ray started here is always a new local one: with no address, Ray joins the cluster named in
# /tmp/ray/ray_current_cluster, which a multi-node Cluster (tests/serve/test_node_loss.py) or another
# `ray start` on the machine writes
FRESH_RAY = {"RAY_ADDRESS": "local"}


def start_serve_cli(command: str, log: Path):
    """`command` (a `serve …` line) as a user starts it: a fresh local Ray, no usage reports, output
    to ``log``, its own process group with SIGINT as in a terminal (a shell's background job
    inherits it ignored): Ctrl-C must work. Returns the Popen."""
    import signal
    import subprocess

    env = os.environ | FRESH_RAY | {"RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        return subprocess.Popen(
            command.split(),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def example_adapter_names() -> list[str]:
    from adapters_store.sources import local_adapters
    from app.generate import EXAMPLE_ADAPTERS

    return sorted(local_adapters(EXAMPLE_ADAPTERS))


# One local Ray + Serve for the whole session (starting one costs ~15 s on 2 cores): each
# module deploys its applications on it and deletes them when done. It starts again only for
# a module whose workers need another environment (env_vars are set when Ray starts), and is
# stopped before a module that starts a Ray of its own (release_shared) and at the session's end.
SHARED_CPUS = 8  # logical CPUs: room for the largest module's replicas (each asks for a share)
_shared: dict = {}


def shared_serve(env: dict[str, str] | None = None, num_cpus: int = SHARED_CPUS) -> dict:
    """This session's Ray + Serve, started if needed; {"url", "metrics_port"}."""
    import ray
    from ray import serve

    key = (tuple(sorted((env or {}).items())), max(num_cpus, SHARED_CPUS))
    if _shared.get("key") == key and ray.is_initialized():
        return _shared
    release_shared()
    metrics_port = free_port()
    ray.init(
        address=FRESH_RAY["RAY_ADDRESS"],
        num_cpus=key[1],
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env} if env else None,
        _metrics_export_port=metrics_port,  # tests/serve/test_autoscaling_serve.py scrapes it
        _system_config={"metrics_report_interval_ms": 1000},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _shared.update(key=key, url=f"http://127.0.0.1:{port}", metrics_port=metrics_port)
    return _shared


def release_shared() -> None:
    """Stop the shared Ray (if this process started one)."""
    if not _shared:
        return
    import ray
    from ray import serve

    _shared.clear()
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def delete_apps() -> None:
    """Delete every application on the shared Serve: the next module starts from none."""
    from ray import serve

    for name in list(serve.status().applications):
        serve.delete(name)


@contextmanager
def serving(apps: dict[str, tuple[object, str]], num_cpus: int = 2, env: dict[str, str] | None = None):
    """Deploy {name: (application, route_prefix)} on the session's Ray (its workers get ``env``
    on top of this process's environment; at least ``num_cpus`` logical CPUs); yields the base
    URL. On the way out every application deployed meanwhile is deleted."""
    from ray import serve

    url = shared_serve(env, num_cpus)["url"]
    try:
        serve.run_many([serve.RunTarget(app, name=name, route_prefix=prefix) for name, (app, prefix) in apps.items()])
        yield url
    finally:
        delete_apps()


def replica_stats(app: str = APP) -> dict:
    """The engine's live counters (running, waiting, free_kv_blocks, max_batch_seen, …)."""
    from ray import serve

    return serve.get_deployment_handle("LoraReplica", app).stats.remote().result()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.2):
    """Poll until predicate() returns something truthy; return it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


FAIL_SEED = 4242  # a request with this seed makes the engine's step fail once it has 3 tokens


def engine_failing_on_seed(settings):
    """A real engine, plus a fault to inject: the step fails while a FAIL_SEED request runs."""
    from app.serving.replica import build_async_engine

    engine = build_async_engine(settings)
    core, step = engine.core, engine.core.step

    def step_or_fail():
        if any(s.params.seed == FAIL_SEED and len(s.output_ids) >= 3 for s in core.scheduler.running):
            raise RuntimeError("injected engine failure")
        return step()

    core.step = step_or_fail
    return engine


FLAKY_ADAPTER = "flaky"  # an adapter of this name parses fine but fails its copy into a pool slot


def engine_with_flaky_adapter_load(settings):
    """A real engine whose pool fails to load the adapter named FLAKY_ADAPTER (as a failed
    host→device copy would), mid-batch, while every other adapter loads as usual."""
    from app.serving.replica import build_async_engine

    engine = build_async_engine(settings)
    pool = engine.core.model.lora_pool
    load = pool._load

    def load_or_fail(slot, weights):
        if weights.name == FLAKY_ADAPTER:
            raise RuntimeError("injected adapter copy failure")
        return load(slot, weights)

    pool._load = load_or_fail
    return engine


# A prompt that starts so is held inside the Ingress's tokenizer call until the test opens the
# gate: the test then knows, without timing, that a tokenization is under way on the Ingress.
GATED_PREFIX = "<<held-in-the-tokenizer>> "
_GATE = ("tokenize-gate", "loraplex-tests")  # a named actor (name, namespace): test and Ingress meet there


class _Gate:
    def __init__(self):
        import asyncio

        self.entered, self.opened = asyncio.Event(), asyncio.Event()

    async def enter(self):
        self.entered.set()

    async def wait_entered(self):
        await self.entered.wait()

    async def open(self):
        self.opened.set()

    async def wait_opened(self):
        await self.opened.wait()


def gated_tokenizer(path):
    """The checkpoint's tokenizer, whose call on a GATED_PREFIX text tells the gate it has
    begun and then waits (on the Ingress's pool thread) until the gate is opened."""
    import ray

    from app.engine.factory import load_tokenizer

    tokenizer = load_tokenizer(path)

    class Gated(type(tokenizer)):
        def __call__(self, text, *args, **kwargs):
            if isinstance(text, str) and text.startswith(GATED_PREFIX):
                gate = ray.get_actor(_GATE[0], namespace=_GATE[1])
                ray.get(gate.enter.remote())
                ray.get(gate.wait_opened.remote())
            return super().__call__(text, *args, **kwargs)

    tokenizer.__class__ = Gated  # the per-thread deep copies keep the class
    return tokenizer


@contextmanager
def tokenize_gate(timeout_s: float = 120.0):
    """Yields the gate: .entered() is True once a GATED_PREFIX tokenization holds there (False
    after timeout_s, a bound only a broken Ingress reaches), .open() lets it go on. Open it
    before waiting for that request; on the way out it is opened (again) and removed."""
    import ray

    actor = ray.remote(num_cpus=0)(_Gate).options(name=_GATE[0], namespace=_GATE[1]).remote()

    def entered() -> bool:
        ready, _ = ray.wait([actor.wait_entered.remote()], timeout=timeout_s)
        return bool(ready)

    try:
        yield SimpleNamespace(entered=entered, open=lambda: ray.get(actor.open.remote()))
    finally:
        ray.get(actor.open.remote())
        ray.kill(actor)
