"""Streams through redeploys, on real Ray Serve with the whole app (proxy, Ingress,
registry, 3 LoraReplicas): nothing lost, nothing cut.

    python -m benchmarks.upgrade_faults

A Poisson stream of streaming `/v1/completions` requests runs over HTTP while the
application is redeployed twice: a config change (its args differ) and a model upgrade
(a new checkpoint path). Either is a heavy update for Serve: every Ingress, LoraReplica
and registry replica is replaced. Replicas run the simulated engine core
(benchmarks/simulated_engine.py: real scheduling and KV accounting; a token is a fixed function
of prompt and position, text " <id>"), so each stream is checked token for token; the
Ingress uses a tiny checkpoint's tokenizer. Counted per request: complete and identical,
an explicit error (error event, then `[DONE]`), lost (a bare close, no `[DONE]`, or
tokens that differ), duplicated tokens. The simulated tokens do not depend on the
weights, so the model upgrade measures the replacement mechanics only (a stream moved
onto the new model's replicas is not refused: docs/faults.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import pathlib
import random
import socket
import tempfile
import time

OUT = pathlib.Path(__file__).resolve().parent / "results" / "upgrade_faults.json"
REPLICAS, MAX_BATCH, STEP_S, RATE = 3, 8, 0.02, 4.0


def build(model: pathlib.Path, max_body_bytes: int):
    from app.builder import app_from_args
    from benchmarks.simulated_engine import StepTime, simulated_engine

    args = {
        "model": str(model),
        "max_batch_size": MAX_BATCH,
        "num_kv_blocks": 256,
        "block_size": 4,
        "max_model_len": 256,
        "max_body_bytes": max_body_bytes,
        "cluster": {"routing_stats_period_s": 0.2, "max_migrations": 64, "failover_wait_s": 120},
        "replica": {"num_replicas": REPLICAS, "ray_actor_options": {"num_cpus": 0.1}},
        "ingress": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
    }
    return app_from_args(args, engine_factory=functools.partial(simulated_engine, StepTime(STEP_S)))


async def one(client, i: int, out: dict):
    from benchmarks.simulated_engine import simulated_token

    rng = random.Random(i)
    prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(4, 12))]
    n = rng.randint(40, 120)
    body = {"model": "model", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    events = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except Exception as exc:  # a bare close: the client saw no end
        out["bare_closes"] += 1
        out["examples"].append(f"{i}: {type(exc).__name__} after {len(events)} events")
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events if e.startswith("{") and '"choices"' in e)
    tokens = [int(t) for t in text.split()]
    want = [simulated_token(tuple(prompt), p) for p in range(n)]
    out["duplicated_tokens"] += max(0, len(tokens) - n)
    errors = [e for e in events if e.startswith("{") and '"error"' in e]
    if events and events[-1] == "[DONE]" and errors:
        out["explicit_errors"] += 1
        out["examples"].append(f"{i}: {errors[0][:200]}")
    elif events and events[-1] == "[DONE]" and tokens == want:
        out["complete"] += 1
    else:
        out["lost"] += 1


async def traffic(url: str, lead_s: float, redeploys: list[tuple[str, callable]]):
    """Poisson arrivals from the start until lead_s after the last change was applied; the
    changes run one after another, the first lead_s in, each lead_s after the previous."""
    import httpx

    out = {"complete": 0, "explicit_errors": 0, "lost": 0, "bare_closes": 0, "duplicated_tokens": 0, "examples": []}
    start, done, finished = time.time(), [], asyncio.Event()

    async def changes():
        for name, apply in redeploys:
            await asyncio.sleep(lead_s)
            began = time.time() - start
            await asyncio.get_running_loop().run_in_executor(None, apply)
            done.append({"change": name, "at_s": began, "applied_s": time.time() - start})
        await asyncio.sleep(lead_s)
        finished.set()

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        rng, tasks = random.Random(7), []
        change_task = asyncio.ensure_future(changes())
        while not finished.is_set():
            tasks.append(asyncio.ensure_future(one(client, len(tasks), out)))
            await asyncio.sleep(rng.expovariate(RATE))
        await asyncio.gather(change_task, *tasks)
    out.update(requests=len(tasks), wall_s=time.time() - start, changes=done)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lead-s", type=float, default=20.0, help="traffic before, between and after the changes")
    a = ap.parse_args()
    import ray
    from ray import serve

    from benchmarks.checkpoints import make_tiny_chat_llama

    root = pathlib.Path(tempfile.mkdtemp(prefix="upgrade-"))
    old, new = make_tiny_chat_llama(root / "v1" / "model", seed=0), make_tiny_chat_llama(root / "v2" / "model", seed=1)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    with socket.socket() as probe:  # a free port for Serve's proxy
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(old, 1 << 22), name="loraplex", route_prefix="/")
    redeploy = lambda model, body: lambda: serve.run(build(model, body), name="loraplex", route_prefix="/")  # noqa: E731
    result = asyncio.run(
        traffic(
            f"http://127.0.0.1:{port}",
            a.lead_s,
            [
                ("config change (args differ)", redeploy(old, 1 << 21)),
                ("model upgrade (new checkpoint path)", redeploy(new, 1 << 21)),
            ],
        )
    )
    serve.shutdown()
    ray.shutdown()
    result.update(
        date=datetime.date.today().isoformat(),
        machine="CPU, simulated engine (see docstring)",
        replicas=REPLICAS,
        step_s=STEP_S,
        rate_per_s=RATE,
    )
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))


if __name__ == "__main__":
    main()
