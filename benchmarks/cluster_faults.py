"""Nothing lost under faults, on real Ray Serve with 3 LoraReplica replicas.

    python -m benchmarks.cluster_faults

Two phases, every stream checked token for token against its uninterrupted output:
- kills: 20 `ray.kill`s of replica actors holding streams in flight (one every 4 s,
  each time the replica of a running stream); every stream must complete identical.
- soak: 500 requests, Poisson arrivals, small KV caches (forced migrations), 10 % of
  clients disconnect mid-stream, 2 replica kills; every request must end exactly once
  (complete and identical, or cancelled by its own client), and afterwards every
  replica reports 0 running, 0 waiting and all KV blocks free.
Replicas run the simulated engine core (benchmarks/simulated_engine.py: the real scheduler,
KV accounting and preemption; a step sleeps a fixed time; tokens are a fixed function of
prompt and position, so a resumed stream is checked exactly). The client is this
process: a DeploymentHandle + app.openai.client_stream's ResubmittingStream, as in the ingress.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import pathlib
import random
import time

OUT = pathlib.Path(__file__).resolve().parent / "results" / "cluster_faults.json"
REPLICAS, MAX_BATCH, STEP_S = 3, 8, 0.01
FAILOVER_WAIT_S = 120  # a moved request may wait this long for a replica (replacements start slowly on 2 cores)


def deploy(app: str, num_kv_blocks: int):
    from ray import serve

    from app.engine.config import EngineConfig
    from app.serving.config import parse_args
    from app.serving.replica import LoraReplica, ReplicaSettings
    from benchmarks.simulated_engine import StepTime, simulated_engine

    args = {
        "max_batch_size": MAX_BATCH,
        "num_kv_blocks": num_kv_blocks,
        "block_size": 4,
        "cluster": {"routing_stats_period_s": 0.2, "max_migrations": 64, "failover_wait_s": FAILOVER_WAIT_S},
        "replica": {"num_replicas": REPLICAS, "ray_actor_options": {"num_cpus": 0.1}},
    }
    settings = ReplicaSettings(
        None, EngineConfig(max_num_seqs=MAX_BATCH, num_kv_blocks=num_kv_blocks, block_size=4), (), migrate_locally=False
    )
    replica = LoraReplica.options(**parse_args(args, "simulated").replica_options).bind(
        settings, None, functools.partial(simulated_engine, StepTime(STEP_S))
    )
    serve.run(replica, name=app, route_prefix=None)
    handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True)
    return lambda r: handle.generate.remote(r, None, 0)


def kill(app: str, replica_id: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#LoraReplica#{replica_id}", namespace="serve"), no_restart=True)


def replica_reports(app: str) -> list[dict]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#LoraReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return [ray.get(ray.get_actor(n, namespace="serve").record_routing_stats.remote(), timeout=30) for n in names]


async def run(app: str, submit, arrivals, kills_wanted: int, kill_every_s: float, disconnect: float, seed: int):
    from app.openai.client_stream import MigrationPolicy, ResubmittingStream
    from app.openai.live_streams import LiveStreams
    from app.protocol import GenerateRequest, SamplingParams
    from benchmarks.simulated_engine import simulated_token
    from cluster.leaving import register_streams

    live_streams = LiveStreams()  # as the ingress's: told by this process's routers of replicas leaving
    register_streams(live_streams)
    live: dict[str, str] = {}  # request id → its replica now
    kills: list[str] = []
    timeline: list[tuple[float, str]] = []  # (seconds from start, "kill" | a move's reason)
    out = {
        "complete": 0,
        "cancelled": 0,
        "lost": 0,
        "duplicated_tokens": 0,
        "migrations": 0,
        "failovers": 0,
        "ended_twice": 0,
    }
    start = time.time()

    async def killer():
        while len(kills) < kills_wanted:
            await asyncio.sleep(kill_every_s)
            targets = sorted(set(live.values()) - set(kills))
            if targets:
                kills.append(random.Random(len(kills)).choice(targets))
                kill(app, kills[-1])
                timeline.append((time.time() - start, "kill"))

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, start + at - time.time()))
        rng = random.Random(seed * 1_000_003 + i)
        prompt = tuple(rng.randrange(32000) for _ in range(rng.randint(4, 12)))
        n = rng.randint(20, 60)
        leave_at = rng.randint(1, n - 1) if rng.random() < disconnect else None
        request = GenerateRequest(f"{app}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, seed=i))
        tokens, ends, seen, last = [], 0, [], None
        policy = MigrationPolicy(max_migrations=64, failover_wait_s=FAILOVER_WAIT_S)
        stream = await ResubmittingStream.open(submit, request, policy, live_streams)
        chunks = stream.chunks()
        async for chunk in chunks:
            moved = stream.moves[len(seen) :]
            seen += moved
            timeline.extend((time.time() - start, reason) for reason, _ in moved)
            live[request.request_id] = stream.replica
            tokens += getattr(chunk, "token_ids", ())
            last = chunk
            ends += bool(getattr(chunk, "finish_reason", None)) or not hasattr(chunk, "token_ids")
            if leave_at is not None and len(tokens) >= leave_at:
                break
        await chunks.aclose()
        live.pop(request.request_id, None)
        want = [simulated_token(prompt, p) for p in range(n)]
        out["duplicated_tokens"] += max(0, len(tokens) - n) + sum(a != b for a, b in zip(tokens, want))
        out["ended_twice"] += ends > 1
        out["migrations"] += len(stream.moves)
        out["failovers"] += sum(r == "failover" for r, _ in stream.moves)
        if leave_at is not None and tokens == want[: len(tokens)] and len(tokens) < n:
            out["cancelled"] += 1
        elif tokens == want:
            out["complete"] += 1
        else:
            out["lost"] += 1
            out["lost_examples"] = out.get("lost_examples", [])[:4] + [
                f"{request.request_id}: {len(tokens)}/{n} tokens, moves {stream.moves}, last {last!r}"[:400]
            ]

    task = asyncio.ensure_future(killer())
    await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    task.cancel()
    out["kills"] = len(kills)
    out["requests"] = len(arrivals)
    out["wall_s"] = time.time() - start
    out["timeline"] = sorted(timeline)
    return out


def settle(app: str) -> list[dict]:
    """Wait for the replacements, then every replica's report (all must be empty)."""
    import ray

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            reports = replica_reports(app)
        except ray.exceptions.RayError:  # a replacement still starting
            reports = []
        if len(reports) == REPLICAS and all(
            r and r["running"] == r["waiting"] == 0 and r["free_kv_blocks"] == r["total_kv_blocks"] for r in reports
        ):
            return reports
        time.sleep(1)
    return replica_reports(app)


def plot(phases: dict, png: pathlib.Path) -> None:
    """Per phase: kills and moves (by reason) over time, and the outcome counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 3.5))
    for ax, (name, p) in zip(axes, phases.items()):
        reasons = sorted({r for _, r in p["timeline"]})
        for y, reason in enumerate(reasons):
            ax.plot(
                [t for t, r in p["timeline"] if r == reason],
                [y] * sum(r == reason for _, r in p["timeline"]),
                "|",
                markersize=12,
                label=reason,
            )
        ax.set(
            yticks=range(len(reasons)),
            yticklabels=reasons,
            xlabel="seconds",
            title=f"{name}: {p['requests']} requests, {p['complete']} complete, {p['cancelled']} cancelled, "
            f"{p['lost']} lost",
        )
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--soak-requests", type=int, default=500)
    a = ap.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    from ray import serve

    serve.start()
    rng = random.Random(5)
    phases = {}
    submit = deploy("kills", num_kv_blocks=512)
    kill_every_s = 4.0  # about the time Serve takes to start a replacement on two cores
    # a steady stream that outlasts the kills, so every kill hits live streams
    arrivals = [i * 0.1 for i in range(int(a.kills * kill_every_s * 1.2 / 0.1))]
    phases["kills"] = asyncio.run(run("kills", submit, arrivals, a.kills, kill_every_s, 0.0, seed=1))
    phases["kills"]["replicas_after"] = settle("kills")
    serve.delete("kills")
    submit = deploy("soak", num_kv_blocks=48)  # 192 tokens for up to 8 requests of up to 72: preemption
    t, arrivals = 0.0, []
    for _ in range(a.soak_requests):
        t += rng.expovariate(12.0)
        arrivals.append(t)
    phases["soak"] = asyncio.run(run("soak", submit, arrivals, 2, arrivals[-1] / 3, 0.10, seed=2))
    phases["soak"]["replicas_after"] = settle("soak")
    serve.shutdown()
    ray.shutdown()
    total = lambda k: sum(p[k] for p in phases.values())  # noqa: E731
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": "CPU, simulated engine (see docstring)",
        "replicas": REPLICAS,
        "max_batch": MAX_BATCH,
        "step_s": STEP_S,
        "failover_wait_s": FAILOVER_WAIT_S,
        "requests": total("requests"),
        "lost": total("lost"),
        "duplicated_tokens": total("duplicated_tokens"),
        "migrations": total("migrations"),
        "failovers": total("failovers"),
        "kills": total("kills"),
        "phases": phases,
    }
    OUT.write_text(json.dumps(result, indent=1))
    plot(phases, OUT.with_suffix(".png"))
    keys = [
        "requests",
        "complete",
        "cancelled",
        "lost",
        "ended_twice",
        "duplicated_tokens",
        "migrations",
        "failovers",
        "kills",
        "wall_s",
    ]
    print(f"{'':18}" + "".join(f"{p:>10}" for p in phases))
    for k in keys:
        print(
            f"{k:18}"
            + "".join(
                f"{phases[p][k]:>10.1f}" if isinstance(phases[p][k], float) else f"{phases[p][k]!s:>10}" for p in phases
            )
        )
    for p in phases.values():
        print(
            "replicas after:",
            [(r["running"], r["waiting"], r["free_kv_blocks"], r["total_kv_blocks"]) for r in p["replicas_after"]],
        )


if __name__ == "__main__":
    main()
