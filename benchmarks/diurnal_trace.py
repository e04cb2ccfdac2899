"""Punica Fig. 13, time-compressed: a load that rises then falls, through real Ray Serve,
twice in one go — Ray Serve's default request router + default autoscaling policy, then
loraplex's consolidating router + consolidation-aware policy (cluster/).

    python benchmarks/diurnal_trace.py            # two runs of the trace, a few minutes each
    python benchmarks/diurnal_trace.py --plot-only

Poisson arrivals at rate λ(t) = peak · sin(π t / T), adapters Zipf(1.5) over 100 names,
each request 64 prompt tokens and 32 new ones, streamed. Up to 8 LoraReplica replicas
(0.1 CPU each) run the simulated engine core (tests/simulated_engine.py): the real scheduler
and KV accounting, and a step that sleeps the step-time model below instead of computing.
The client is this process: a DeploymentHandle (whose router is the deployment's) and
app.openai.client_stream's ResubmittingStream, as in the ingress; HTTP is left out so two cores
can carry the token rate.

Step-time model, from the measured GPU engine (benchmarks/results/e2e_throughput_h200.json,
Llama-2-7B shapes, Distinct rank-16 adapters): 520 steps in 4.93 s at max batch 32 and 262 in
3.39 s at 64, i.e. 9.48 and 12.95 ms a step → 6.0 ms + 0.108 ms per request in the batch; plus
a prefill term of 0.02 ms per prompt token (2·7e9 FLOP per token at ~700 TFLOP/s, a roofline
figure, not measured). It is stretched ×20 (the trace is compressed ×~1000 against a day) so
the token rate fits two cores.

Per policy: replica-seconds (replica actors alive, sampled every 0.5 s), the share of
replica-time at batch 0 or at max batch, TTFT and time between tokens seen by the client
(p50/p99), requests lost (not complete with all 32 tokens), migrations, scale events.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import math
import pathlib
import random
import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.method import save_figure  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results" / "diurnal_trace.json"
DILATION = 20.0
STEP = dict(base_s=0.0060 * DILATION, per_request_s=0.000108 * DILATION, per_prefill_token_s=0.00002 * DILATION)
MAX_BATCH, MAX_REPLICAS, PROMPT, NEW_TOKENS, ADAPTERS, ZIPF = 8, 8, 64, 32, 100, 1.5
DELAYS = {"upscale_delay_s": 1.0, "downscale_delay_s": 5.0}


def trace(duration_s: float, peak_rps: float, seed: int) -> list[tuple[float, str]]:
    """(arrival time, adapter) — a thinned Poisson process at peak · sin(π t / T)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** ZIPF for i in range(ADAPTERS)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak_rps)
        if t >= duration_s:
            return out
        if rng.random() < math.sin(math.pi * t / duration_s):
            out.append((t, f"adapter-{rng.choices(range(ADAPTERS), weights)[0]}"))


def deployment_options(policy: str) -> dict:
    from app.serving.config import parse_args

    autoscaling = {
        "min_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        **DELAYS,
    }
    if policy == "default":  # Ray Serve's router and queue-length policy (its default target, 2 ongoing)
        autoscaling["policy"] = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    # max_ongoing_requests = the batch for both: Serve then never queues more in a replica than
    # it batches, so requests that find no room wait at the router, where the autoscaler sees them
    args = {
        "max_batch_size": MAX_BATCH,
        "num_kv_blocks": 512,
        "block_size": 16,
        "replica": {
            "autoscaling_config": autoscaling,
            "max_ongoing_requests": MAX_BATCH,
            "ray_actor_options": {"num_cpus": 0.1},
        },
    }
    options = parse_args(args, "simulated").replica_options
    if policy == "default":
        options.pop("request_router_config", None)
    return options


class Sampler:
    """Every replica actor of the app: alive count and each one's batch, every period_s
    (one stats call in flight per replica, so a starting replica stalls no sample)."""

    def __init__(self, app: str, period_s: float = 0.5):
        self.prefix, self.period_s = f"SERVE_REPLICA::{app}#LoraReplica#", period_s
        self.rows: list[tuple[float, dict[str, int]]] = []  # (t, replica → running; −1 = not reporting yet)
        self._handles, self._asked, self._last = {}, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        import ray

        while not self._stop.wait(self.period_s):
            names = [
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(self.prefix)
            ]
            for n in names:
                self._handles.setdefault(n, ray.get_actor(n, namespace="serve"))
                if n not in self._asked.values():
                    self._asked[self._handles[n].record_routing_stats.remote()] = n
            ready, _ = ray.wait(list(self._asked), num_returns=len(self._asked), timeout=0.2)
            for ref in ready:
                n = self._asked.pop(ref)
                try:
                    stats = ray.get(ref)
                    self._last[n] = stats["running"] if stats else -1
                except Exception:  # constructing or stopped
                    self._last[n] = -1
            self.rows.append((time.time(), {n[len(self.prefix) :]: self._last.get(n, -1) for n in names}))


def simulated_replica(policy: str):
    """The LoraReplica deployment with the simulated engine core (the CPU run)."""
    from app.engine.config import EngineConfig
    from app.serving.replica import LoraReplica, ReplicaSettings
    from tests.simulated_engine import StepTime, simulated_engine

    settings = ReplicaSettings(
        None, EngineConfig(max_num_seqs=MAX_BATCH, num_kv_blocks=512, block_size=16), (), migrate_locally=False
    )
    return LoraReplica.options(**deployment_options(policy)).bind(
        settings, None, functools.partial(simulated_engine, StepTime(**STEP))
    )


async def run_policy(
    policy: str,
    arrivals,
    replica,
    max_batch: int = MAX_BATCH,
    new_tokens: int = NEW_TOKENS,
    vocab: int = 32000,
    step: dict | None = STEP,
) -> dict:
    """Replay ``arrivals`` through the bound LoraReplica deployment ``replica``; the summary
    (``step``: the step-time model the replicas sleep, None for a real engine)."""
    from ray import serve

    from app.openai.client_stream import MigrationPolicy, ResubmittingStream
    from app.protocol import GenerateRequest, SamplingParams

    app = f"diurnal-{policy}"
    serve.run(replica, name=app, route_prefix=None)
    handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True)
    submit = lambda r: handle.generate.remote(r, None, 0)  # noqa: E731
    sampler = Sampler(app)
    sampler._thread.start()
    records = []
    start = time.time()

    async def one(i: int, at: float, adapter: str):
        await asyncio.sleep(max(0.0, start + at - time.time()))
        rng = random.Random(i)
        request = GenerateRequest(
            f"{policy}-{i}",
            tuple(rng.randrange(vocab) for _ in range(PROMPT)),
            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=i),
            adapter,
        )
        sent, times, tokens, moves, ok = time.time(), [], 0, 0, False
        try:
            stream = await ResubmittingStream.open(
                submit, request, MigrationPolicy(max_migrations=8, failover_wait_s=60)
            )
            async for chunk in stream.chunks():
                if getattr(chunk, "token_ids", None):
                    times.append(time.time())
                    tokens += len(chunk.token_ids)
            moves = len(stream.moves)
            ok = tokens == new_tokens
        except Exception as exc:  # counted as lost, with its reason
            print(f"  {request.request_id} lost: {type(exc).__name__}: {exc}", flush=True)
        records.append({"arrival": sent - start, "times": [t - start for t in times], "ok": ok, "moves": moves})

    await asyncio.gather(*(one(i, at, a) for i, (at, a) in enumerate(arrivals)))
    await asyncio.sleep(DELAYS["downscale_delay_s"] + 3)  # the tail: idle replicas go
    sampler._stop.set()
    sampler._thread.join()
    serve.delete(app)
    return summarize(records, sampler.rows, start, max_batch, step)


def summarize(records, rows, start, max_batch, step: dict | None = STEP) -> dict:
    ts = np.array([t - start for t, _ in rows])
    counts = np.array([len(r) for _, r in rows])
    dt = np.diff(ts, append=ts[-1])
    batches = [b for _, r in rows for b in r.values() if b >= 0]
    replica_time = [(d, b) for (_, r), d in zip(rows, dt) for b in r.values() if b >= 0]
    total = sum(d for d, _ in replica_time) or 1.0
    edge = sum(d for d, b in replica_time if b == 0 or b >= max_batch) / total
    ttft = [r["times"][0] - r["arrival"] for r in records if r["times"]]
    tbt = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    scale_events = int(np.count_nonzero(np.diff(counts)))
    busy = [b for b in batches if b > 0]
    # did the replicas keep the step-time model on this machine? a token per step, so the
    # median gap between tokens should be the modeled decode step at the typical batch
    modeled = step["base_s"] + step["per_request_s"] * float(np.median(busy)) if busy and step else None
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {
        "requests": len(records),
        "lost": sum(not r["ok"] for r in records),
        "replica_seconds": float(np.sum(counts * dt)),
        "share_batch_0_or_max": edge,
        "share_batch_0": sum(d for d, b in replica_time if b == 0) / total,
        "share_batch_max": sum(d for d, b in replica_time if b >= max_batch) / total,
        "p50_ttft_s": pct(ttft, 50),
        "p99_ttft_s": pct(ttft, 99),
        "p50_tbt_s": pct(tbt, 50),
        "p99_tbt_s": pct(tbt, 99),
        "modeled_step_s": modeled,
        "p50_tbt_over_model": pct(tbt, 50) / modeled if modeled and tbt else None,
        "migrations": sum(r["moves"] for r in records),
        "scale_events": scale_events,
        "max_replicas_seen": int(counts.max()) if len(counts) else 0,
        "mean_batch": float(np.mean(batches)) if batches else 0,
        "timeline": {
            "t": ts.round(2).tolist(),
            "replicas": counts.tolist(),
            "batches": [{k[-8:]: v for k, v in r.items()} for _, r in rows],
            "arrivals": [round(r["arrival"], 2) for r in records],
            "tokens": [round(t, 2) for r in records for t in r["times"]],
        },
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    styles = {"default": ("tab:gray", "Ray Serve default router + autoscaler"), "loraplex": ("tab:blue", "loraplex")}
    for name, (color, label) in styles.items():
        r = result["policies"][name]["timeline"]
        end = max(r["t"]) if r["t"] else 1
        bins = np.arange(0, end + 5, 5)
        axes[0].hist(
            r["arrivals"],
            bins=bins,
            histtype="step",
            color=color,
            weights=[1 / 5] * len(r["arrivals"]),
            label=f"{label}: requests/s",
        )
        axes[0].step(r["t"], r["replicas"], where="post", color=color, linestyle="--", label=f"{label}: replicas")
        axes[1].hist(
            r["tokens"], bins=bins, histtype="step", color=color, weights=[1 / 5] * len(r["tokens"]), label=label
        )
        names = sorted({k for row in r["batches"] for k in row})
        for k in names:
            axes[2].plot(
                r["t"],
                [row.get(k, np.nan) if row.get(k, -1) >= 0 else np.nan for row in r["batches"]],
                color=color,
                alpha=0.6,
                linewidth=0.8,
            )
    axes[0].set_ylabel("requests/s, replicas")
    axes[1].set_ylabel("tokens/s")
    axes[2].set_ylabel("batch per replica")
    axes[2].set_xlabel("seconds into the trace")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    save_figure(
        fig,
        f"diurnal trace (Punica Fig. 13, compressed): loraplex / default replica-seconds "
        f"{result['replica_seconds_ratio']:.2f}",
        path,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of rising-then-falling load")
    ap.add_argument("--peak-rps", type=float, default=7.0)
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(OUT.read_text()), OUT.with_suffix(".png"))
        return
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from ray import serve

    serve.start()
    arrivals = trace(a.duration, a.peak_rps, seed=13)
    policies = {}
    for policy in ("default", "loraplex"):
        print(f"{policy}: {len(arrivals)} requests over {a.duration:g} s", flush=True)
        policies[policy] = asyncio.run(run_policy(policy, arrivals, simulated_replica(policy)))
    serve.shutdown()
    ray.shutdown()
    ratio = policies["loraplex"]["replica_seconds"] / policies["default"]["replica_seconds"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": "2 CPU cores, simulated engine (see docstring)",
        "step_time_model_s": STEP,
        "dilation": DILATION,
        "max_batch": MAX_BATCH,
        "max_replicas": MAX_REPLICAS,
        "prompt_tokens": PROMPT,
        "new_tokens": NEW_TOKENS,
        "adapters": ADAPTERS,
        "zipf": ZIPF,
        "delays": DELAYS,
        "duration_s": a.duration,
        "peak_rps": a.peak_rps,
        "replica_seconds_ratio": ratio,
        "policies": policies,
    }
    OUT.write_text(json.dumps(result, indent=1))
    keys = [
        "requests",
        "lost",
        "replica_seconds",
        "share_batch_0_or_max",
        "p50_ttft_s",
        "p99_ttft_s",
        "p50_tbt_s",
        "p99_tbt_s",
        "p50_tbt_over_model",
        "migrations",
        "scale_events",
        "max_replicas_seen",
    ]
    print(f"{'':24}" + "".join(f"{p:>14}" for p in policies))
    for k in keys:
        print(
            f"{k:24}"
            + "".join(
                f"{policies[p][k]:>14.3f}" if isinstance(policies[p][k], float) else f"{policies[p][k]!s:>14}"
                for p in policies
            )
        )
    print(f"replica_seconds_ratio (loraplex / default): {ratio:.3f}")
    plot(result, OUT.with_suffix(".png"))


if __name__ == "__main__":
    main()
