"""Routing on a fixed cluster: one Poisson trace through Ray Serve's default router
(power of two choices) and through loraplex's consolidating router (cluster/router.py),
on 4 LoraReplica replicas, in one run.

    python -m benchmarks.cluster_routing            # two runs of the trace, ~1 min each
    python -m benchmarks.cluster_routing --plot-only

Replicas run the simulated engine core (benchmarks/simulated_engine.py: the real scheduler and
KV accounting, a step that sleeps the step-time model of benchmarks/diurnal_trace.py —
the H200 roofline of Llama-2-7B from measured figures, stretched ×20 to fit two cores)
and emit a token sequence that is a fixed function of prompt and position, so every
stream is checked token for token: lost = a request not complete, duplicated = tokens
beyond or different from the expected ones. The client is this process (DeploymentHandle
+ app.openai.client_stream's ResubmittingStream, as in the ingress).

Per router: per-replica batch over time (PNG, Punica Fig. 13 bottom panel), the share of
replica-time at batch 0 or at max batch, replicas that sat idle (never above batch 0),
p50/p99 time between tokens, migrations and failovers.
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

import numpy as np

from benchmarks.diurnal_trace import STEP, Sampler, summarize
from benchmarks.method import save_figure

OUT = pathlib.Path(__file__).resolve().parent / "results" / "cluster_routing.json"
REPLICAS, MAX_BATCH, PROMPT, NEW_TOKENS = 4, 8, 32, (16, 48)


async def run_router(router: str, arrivals: list[float], seed: int) -> dict:
    from ray import serve

    from app.engine.config import EngineConfig
    from app.openai.client_stream import MigrationPolicy, ResubmittingStream
    from app.openai.live_streams import LiveStreams
    from app.protocol import GenerateRequest, SamplingParams
    from app.serving.config import parse_args
    from app.serving.replica import LoraReplica, ReplicaSettings
    from benchmarks.simulated_engine import StepTime, simulated_engine, simulated_token
    from cluster.leaving import register_streams

    app = f"routing-{router}"
    live = LiveStreams()  # as the ingress's: told by this process's routers of replicas leaving
    register_streams(live)
    args = {
        "max_batch_size": MAX_BATCH,
        "num_kv_blocks": 128,
        "block_size": 16,
        "cluster": {"router": router, "routing_stats_period_s": 0.2},
        "replica": {"num_replicas": REPLICAS, "ray_actor_options": {"num_cpus": 0.1}},
    }
    settings = ReplicaSettings(
        None, EngineConfig(max_num_seqs=MAX_BATCH, num_kv_blocks=128, block_size=16), (), migrate_locally=False
    )
    replica = LoraReplica.options(**parse_args(args, "simulated").replica_options).bind(
        settings, None, functools.partial(simulated_engine, StepTime(**STEP))
    )
    serve.run(replica, name=app, route_prefix=None)
    handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True)
    submit = lambda r: handle.generate.remote(r, None, 0)  # noqa: E731
    sampler = Sampler(app, period_s=0.25)
    sampler._thread.start()
    records, duplicated = [], [0]
    start = time.time()

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, start + at - time.time()))
        rng = random.Random(seed * 100_000 + i)
        prompt = tuple(rng.randrange(32000) for _ in range(PROMPT))
        n = rng.randint(*NEW_TOKENS)
        request = GenerateRequest(f"{router}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, seed=i))
        sent, times, tokens, moves = time.time(), [], [], []
        try:
            stream = await ResubmittingStream.open(
                submit, request, MigrationPolicy(max_migrations=8, failover_wait_s=60), live
            )
            async for chunk in stream.chunks():
                if getattr(chunk, "token_ids", None):
                    times.append(time.time())
                    tokens += chunk.token_ids
            moves = stream.moves
        except Exception as exc:
            print(f"  {request.request_id} lost: {type(exc).__name__}: {exc}", flush=True)
        want = [simulated_token(prompt, p) for p in range(n)]
        duplicated[0] += max(0, len(tokens) - n) + sum(a != b for a, b in zip(tokens, want))
        records.append(
            {
                "arrival": sent - start,
                "times": [t - start for t in times],
                "ok": tokens == want,
                "moves": len(moves),
                "failovers": sum(r == "failover" for r, _ in moves),
            }
        )

    await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    await asyncio.sleep(1.0)
    sampler._stop.set()
    sampler._thread.join()
    serve.delete(app)
    out = summarize(records, sampler.rows, start, MAX_BATCH)
    per_replica = {}
    for _, row in sampler.rows:
        for k, b in row.items():
            per_replica.setdefault(k, []).append(b)
    out["idle_replicas"] = sum(max(bs) <= 0 for bs in per_replica.values())
    out["duplicated_tokens"] = duplicated[0]
    out["failovers"] = sum(r["failovers"] for r in records)
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for ax, name in zip(axes, ("power_of_two", "consolidating")):
        r = result["routers"][name]
        names = sorted({k for row in r["timeline"]["batches"] for k in row})
        for k in names:
            ax.step(
                r["timeline"]["t"],
                [max(0, row.get(k, 0)) for row in r["timeline"]["batches"]],
                where="post",
                linewidth=1.0,
                label=f"replica {k}",
            )
        ax.set_ylabel("batch size")
        ax.set_title(
            f"{name}: {100 * r['share_batch_0_or_max']:.0f}% of replica-time at batch 0 or {MAX_BATCH}, "
            f"{r['idle_replicas']} replicas idle",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right")
    axes[1].set_xlabel("seconds into the trace")
    save_figure(fig, f"per-replica batch size, {result['requests']} requests, {REPLICAS} replicas", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(OUT.read_text()), OUT.with_suffix(".png"))
        return
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    from ray import serve

    serve.start()
    rng = random.Random(13)
    arrivals = list(np.cumsum([rng.expovariate(a.rps) for _ in range(a.requests)]))
    routers = {}
    for router in ("power_of_two", "consolidating"):
        print(f"{router}: {len(arrivals)} requests at {a.rps:g}/s", flush=True)
        routers[router] = asyncio.run(run_router(router, arrivals, seed=13))
    serve.shutdown()
    ray.shutdown()
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": "2 CPU cores, simulated engine (see docstring)",
        "step_time_model_s": STEP,
        "replicas": REPLICAS,
        "max_batch": MAX_BATCH,
        "rps": a.rps,
        "requests": sum(r["requests"] for r in routers.values()),
        "lost": sum(r["lost"] for r in routers.values()),
        "duplicated_tokens": sum(r["duplicated_tokens"] for r in routers.values()),
        "migrations": sum(r["migrations"] for r in routers.values()),
        "failovers": sum(r["failovers"] for r in routers.values()),
        "routers": routers,
    }
    OUT.write_text(json.dumps(result, indent=1))
    keys = [
        "requests",
        "lost",
        "duplicated_tokens",
        "share_batch_0_or_max",
        "share_batch_0",
        "share_batch_max",
        "idle_replicas",
        "mean_batch",
        "p50_tbt_s",
        "p99_tbt_s",
        "p50_ttft_s",
        "p99_ttft_s",
        "migrations",
        "failovers",
    ]
    print(f"{'':22}" + "".join(f"{p:>16}" for p in routers))
    for k in keys:
        print(
            f"{k:22}"
            + "".join(
                f"{routers[p][k]:>16.3f}" if isinstance(routers[p][k], float) else f"{routers[p][k]!s:>16}"
                for p in routers
            )
        )
    plot(result, OUT.with_suffix(".png"))


if __name__ == "__main__":
    main()
