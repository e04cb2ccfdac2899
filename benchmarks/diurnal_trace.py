"""Punica Fig. 13, time-compressed: a load that rises then falls, through real Ray Serve,
twice in one go — Ray Serve's default request router + default autoscaling policy, then
loraplex's consolidating router + consolidation-aware policy (cluster/).

    python -m benchmarks.diurnal_trace            # both traces, every arm: ~25 minutes on 2 cores
    python -m benchmarks.diurnal_trace --plot-only
    python -m benchmarks.diurnal_trace --time-scale 0.1 --out /tmp/d.json   # a plumbing check
    # arms side by side, each in a process and Ray of its own on two cores of its own, then one result:
    taskset -c 0,1 python -m benchmarks.diurnal_trace --arms diurnal:default --part a.json &
    taskset -c 2,3 python -m benchmarks.diurnal_trace --arms diurnal:loraplex --part b.json &
    wait; python -m benchmarks.diurnal_trace --merge a.json b.json

Two traces: the diurnal one (240 s) and a ramp 2.7× as steep (90 s, the same peak). Arms:
Ray Serve's defaults and loraplex's on both; on the diurnal trace also two leaner settings
(`high_water` 0.85; `high_water` 1 without the trend); on the steep ramp loraplex without the
demand trend (`upscale_lead_s: 0`) and with a warm spare (`min_idle_replicas: 1`), for what
each costs in replica-seconds. The JSON ends with a `summary`: the loraplex arm on the diurnal
trace against Ray's defaults (replica-seconds ratio, share of replica-time at batch 0 or full,
TTFT p99 ratio, busy releases, lost) and which of issue 50's targets it meets.

Poisson arrivals at rate λ(t) = peak · sin(π t / T), adapters Zipf(1.5) over 100 names,
each request 64 prompt tokens and 32 new ones, streamed. Up to 8 LoraReplica replicas
(0.1 CPU each) run the simulated engine core (benchmarks/simulated_engine.py): the real scheduler
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
import os
import pathlib
import random
import threading
import time

from benchmarks.diurnal_report import against_default, plot, summarize

OUT = pathlib.Path(__file__).resolve().parent / "results" / "diurnal_trace.json"
DILATION = 20.0
STEP = dict(base_s=0.0060 * DILATION, per_request_s=0.000108 * DILATION, per_prefill_token_s=0.00002 * DILATION)
MAX_BATCH, MAX_REPLICAS, PROMPT, NEW_TOKENS, ADAPTERS, ZIPF = 8, 8, 64, 32, 100, 1.5
DELAYS = {"upscale_delay_s": 1.0, "downscale_delay_s": 5.0}
# the traces: Punica Fig. 13 compressed, and a ramp 2.7× as steep (the same peak in a third the time)
TRACES = {"diurnal": (240.0, 7.0), "steep": (90.0, 7.0)}
# arms: Ray Serve's router and policy; loraplex's (cluster/) as configured by default; on the
# diurnal trace also two leaner settings (less room kept ahead: fuller replicas, more waiting),
# and on the steep ramp loraplex without the trend (upscale_lead_s 0) and with a warm spare,
# for what each costs in replica-seconds
ARMS = {
    "default": ("default", {}),
    "loraplex": ("loraplex", {}),
    "loraplex_hw85": ("loraplex", {"high_water": 0.85}),
    "loraplex_full": ("loraplex", {"high_water": 1.0, "upscale_lead_s": 0.0}),
    "loraplex_no_trend": ("loraplex", {"upscale_lead_s": 0.0}),
    "loraplex_spare": ("loraplex", {"min_idle_replicas": 1}),
}
TRACE_ARMS = {
    "diurnal": ("default", "loraplex", "loraplex_hw85", "loraplex_full"),
    "steep": ("default", "loraplex", "loraplex_no_trend", "loraplex_spare"),
}


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


def deployment_options(policy: str, extra: dict | None = None) -> dict:
    from app.serving.config import parse_args

    autoscaling = {
        "min_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        **DELAYS,
        **(extra or {}),
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


def simulated_replica(policy: str, extra: dict | None = None):
    """The LoraReplica deployment with the simulated engine core (the CPU run)."""
    from app.engine.config import EngineConfig
    from app.serving.replica import LoraReplica, ReplicaSettings
    from benchmarks.simulated_engine import StepTime, simulated_engine

    settings = ReplicaSettings(
        None, EngineConfig(max_num_seqs=MAX_BATCH, num_kv_blocks=512, block_size=16), (), migrate_locally=False
    )
    return LoraReplica.options(**deployment_options(policy, extra)).bind(
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
    app: str | None = None,
) -> dict:
    """Replay ``arrivals`` through the bound LoraReplica deployment ``replica``; the summary
    (``step``: the step-time model the replicas sleep, None for a real engine). Busy releases
    are those the consolidating router of this process saw (None for Ray's router)."""
    from ray import serve

    from app.openai.client_stream import MigrationPolicy, ResubmittingStream
    from app.openai.live_streams import LiveStreams
    from app.protocol import GenerateRequest, SamplingParams
    from cluster.leaving import busy_releases, register_streams

    app = app or f"diurnal-{policy}"
    cut = len(busy_releases())
    live = LiveStreams()  # as the ingress's: told by this process's routers of replicas leaving
    register_streams(live)
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
        sent, times, tokens, moves, ok = time.time(), [], 0, [], False
        try:
            stream = await ResubmittingStream.open(
                submit, request, MigrationPolicy(max_migrations=8, failover_wait_s=60), live
            )
            async for chunk in stream.chunks():
                if getattr(chunk, "token_ids", None):
                    times.append(time.time())
                    tokens += len(chunk.token_ids)
            moves = [reason for reason, _ in stream.moves]
            ok = tokens == new_tokens
        except Exception as exc:  # counted as lost, with its reason
            print(f"  {request.request_id} lost: {type(exc).__name__}: {exc}", flush=True)
        record = {"arrival": sent - start, "times": [t - start for t in times], "ok": ok}
        records.append({**record, "moves": len(moves), "reasons": moves})

    await asyncio.gather(*(one(i, at, a) for i, (at, a) in enumerate(arrivals)))
    await asyncio.sleep(DELAYS["downscale_delay_s"] + 3)  # the tail: idle replicas go
    sampler._stop.set()
    sampler._thread.join()
    serve.delete(app)
    cut = len(busy_releases()) - cut if policy != "default" else None
    return summarize(records, sampler.rows, start, max_batch, step, cut)


def run_arms(selection: list[tuple[str, str]], time_scale: float) -> dict:
    """Each (trace, arm) in turn on one Ray: {trace: {duration_s, peak_rps, arms: {arm: summary}}}."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")  # the client is a DeploymentHandle: no HTTP proxy
    runs: dict = {}
    for name, arm in selection:
        duration, peak = TRACES[name]
        run = runs.setdefault(name, {"duration_s": duration * time_scale, "peak_rps": peak, "arms": {}})
        arrivals = trace(run["duration_s"], peak, seed=13)
        print(f"{name} / {arm}: {len(arrivals)} requests over {run['duration_s']:g} s", flush=True)
        policy, extra = ARMS[arm]
        replica = simulated_replica(policy, extra)
        run["arms"][arm] = asyncio.run(run_policy(policy, arrivals, replica, app=f"{name}-{arm}".replace("_", "-")))
    serve.shutdown()
    ray.shutdown()
    return runs


def merged(parts: list[dict]) -> dict:
    """The runs of several parts (arms run side by side, each in a process of its own) as one."""
    runs: dict = {}
    for part in parts:
        for name, run in part["runs"].items():
            runs.setdefault(name, {**run, "arms": {}})["arms"].update(run["arms"])
    runs = {name: runs[name] for name in TRACES if name in runs}  # the diurnal trace first
    for name, run in runs.items():
        arms = run["arms"]
        if "default" not in arms:
            raise SystemExit(f"{name}: no part ran Ray's defaults, the arm every other is measured against")
        run["arms"] = {a: arms[a] for a in ARMS if a in arms}  # Ray's defaults first
        run["against_default"] = {a: against_default(r, arms["default"]) for a, r in arms.items() if a != "default"}
    return runs


KEYS = [
    "requests",
    "lost",
    "replica_seconds",
    "share_batch_0_or_max",
    "share_batch_0",
    "share_batch_max",
    "share_batch_between",
    "share_starting",
    "p50_ttft_s",
    "p99_ttft_s",
    "p50_tbt_s",
    "p99_tbt_s",
    "p50_tbt_over_model",
    "migrations",
    "busy_releases",
    "scale_events",
    "max_replicas_seen",
]


def table(name: str, t: dict) -> None:
    arms = t["arms"]
    print(f"\n{name}: {t['duration_s']:g} s, peak {t['peak_rps']:g} requests/s")
    print(f"{'':24}" + "".join(f"{a:>19}" for a in arms))
    for k in KEYS:
        cells = [arms[a][k] for a in arms]
        print(f"{k:24}" + "".join(f"{c:>19.3f}" if isinstance(c, float) else f"{c!s:>19}" for c in cells))
    for a, s in t["against_default"].items():
        print(f"{a} / default: " + ", ".join(f"{k} {v}" for k, v in s.items() if k != "met"), f"met {s['met']}")


def result(runs: dict, loads: list, machine: str) -> dict:
    """The JSON: the diurnal trace where earlier readers look (policies, replica_seconds_ratio:
    benchmarks/results_serving.py), any other under "traces"; the summary is its loraplex arm."""
    main_name, *more = runs
    main_trace = runs[main_name]
    first = main_trace["against_default"]["loraplex"]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "load_average_before_and_after": loads,  # one [before, after] per process
        "step_time_model_s": STEP,
        "dilation": DILATION,
        "max_batch": MAX_BATCH,
        "max_replicas": MAX_REPLICAS,
        "prompt_tokens": PROMPT,
        "new_tokens": NEW_TOKENS,
        "adapters": ADAPTERS,
        "zipf": ZIPF,
        "delays": DELAYS,
        "arms": {k: {"policy": p, "autoscaling": e} for k, (p, e) in ARMS.items()},
        "trace": main_name,
        "duration_s": main_trace["duration_s"],
        "peak_rps": main_trace["peak_rps"],
        "replica_seconds_ratio": first["replica_seconds_ratio"],
        "policies": main_trace["arms"],
        "against_default": main_trace["against_default"],
        "traces": {name: runs[name] for name in more},
        "summary": first,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="diurnal,steep", help="which of " + ",".join(TRACES))
    ap.add_argument("--arms", help="run only these TRACE:ARM pairs (comma-separated) and write a --part")
    ap.add_argument("--part", type=pathlib.Path, help="where --arms writes its runs, for --merge")
    ap.add_argument("--merge", type=pathlib.Path, nargs="+", help="parts run side by side: one result of them")
    ap.add_argument("--machine", default="2 CPU cores, simulated engine (see docstring)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="shorten the traces (a plumbing check)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    out = a.out
    if a.plot_only:
        d = json.loads(out.read_text())
        for name, t in {d["trace"]: {**d, "arms": d["policies"]}, **d["traces"]}.items():
            plot(t, f"{name} trace (Punica Fig. 13, compressed)", out.with_name(f"{out.stem}_{name}.png"))
        return
    if a.merge:
        parts = [json.loads(p.read_text()) for p in a.merge]
        runs, loads = merged(parts), [p["load_average_before_and_after"] for p in parts]
    else:
        pairs = a.arms.split(",") if a.arms else [f"{t}:{arm}" for t in a.traces.split(",") for arm in TRACE_ARMS[t]]
        load_before = os.getloadavg()
        runs = run_arms([tuple(p.split(":")) for p in pairs], a.time_scale)
        load = [list(load_before), list(os.getloadavg())]
        if a.arms:
            a.part.write_text(json.dumps({"load_average_before_and_after": load, "runs": runs}))
            return
        loads = [load]
        runs = merged([{"runs": runs}])
    out.write_text(json.dumps(result(runs, loads, a.machine), indent=1))
    for name, t in runs.items():
        table(name, t)
        plot(t, f"{name} trace (Punica Fig. 13, compressed)", out.with_name(f"{out.stem}_{name}.png"))
    print(f"load average before / after: {loads}")


if __name__ == "__main__":
    main()
