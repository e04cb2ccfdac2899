"""In-process engine or engine process, on this machine's CPU: which the CPU default should be.

The shipped CPU configuration (serve_config.yaml: the embedded SmolLM2-135M, batch 16) served
through the real Ingress, Serve's proxy and HTTP to CLIENTS closed-loop streaming clients
(benchmarks/sse_load.py), `engine_process: false` against `true`, alternating ROUNDS times as the
machine's other load comes and goes; `--engine simulated` swaps the model for
benchmarks/simulated_engine.py (a 2 ms step that computes nothing), which isolates the path's own
cost: the relay from the engine process is the one thing the two variants do differently there.

    python -m benchmarks.engine_process_cpu                       # real model, ~6 min
    python -m benchmarks.engine_process_cpu --engine simulated
    python -m benchmarks.engine_process_cpu --plot-only

Writes benchmarks/results/engine_process_cpu[_simulated].json + PNG. Each variant runs in its
own process (a fresh Ray) with its own CPU seconds per 1,000 tokens for the replica and, with
the engine process, the engine process.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks.sse_load import completion_body, http_client, summarize

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SETUP = {  # engine → (clients, max_tokens, warm-up s, measured s)
    "real": (8, 64, 10.0, 30.0),
    "simulated": (64, 128, 5.0, 15.0),
}
ROUNDS = 2
REPLICA, ENGINE = "ServeReplica:bench:LoraReplica", "spawn_main"


def _pids() -> dict[str, int]:
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()
    rows = [line.split(None, 2) for line in ps[1:]]
    replica = next((int(p) for p, _, cmd in rows if REPLICA in cmd), None)
    out = {"replica": replica} if replica else {}
    engine = next((int(p) for p, pp, cmd in rows if ENGINE in cmd and int(pp) == replica), None)
    if engine:
        out["engine"] = engine
    return out


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run_variant(engine: str, engine_process: bool) -> dict:
    import ray
    import yaml
    from ray import serve

    from app.builder import app_from_args
    from app.model.default import DEFAULT_MODEL_NAME

    clients, max_tokens, warmup_s, measure_s = SETUP[engine]
    args = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    args.update(engine_process=engine_process, replica={"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}})
    factories = {}
    if engine == "simulated":
        from benchmarks.simulated_engine import StepTime, simulated_engine

        args.update(model_name="base", max_batch_size=clients, num_kv_blocks=2048, adapter_dirs=[])
        factories = {"engine_factory": functools.partial(simulated_engine, StepTime(0.002))}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = 18000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = app_from_args(args, **factories)
    model = "base" if engine == "simulated" else DEFAULT_MODEL_NAME
    serve.run(app, name="bench", route_prefix="/")
    records: list = []
    t0 = time.monotonic() + warmup_s
    body = itertools.repeat(completion_body([11, 22, 33, 44, 55, 66, 77, 88], max_tokens, model))
    cpu: dict[str, float] = {}

    async def load():
        clients_done = asyncio.gather(*(http_client(port, body, t0 + measure_s, records) for _ in range(clients)))
        await asyncio.sleep(warmup_s)
        pids = _pids()
        start = _cpu_seconds(pids)
        await asyncio.sleep(measure_s)
        cpu.update({k: v - start[k] for k, v in _cpu_seconds(pids).items()})
        await clients_done

    asyncio.run(load())
    serve.shutdown()
    ray.shutdown()
    summary = summarize(records, t0, t0 + measure_s)
    return {
        "engine": engine,
        "engine_process": engine_process,
        "clients": clients,
        "max_tokens": max_tokens,
        **summary,
        "cpu_s_per_1k_tokens": {
            k: round(v / max(summary["tok_s"] * measure_s / 1000, 1e-9), 3) for k, v in cpu.items()
        },
    }


def _child(engine: str, engine_process: bool) -> dict:
    out = pathlib.Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    flag = "process" if engine_process else "in"
    variant = ["--variant", flag, "--engine", engine, "--out", str(out)]
    cmd = [sys.executable, "-m", "benchmarks.engine_process_cpu", *variant]
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return json.loads(out.read_text())


def _out(engine: str) -> pathlib.Path:
    return RESULTS / ("engine_process_cpu.json" if engine == "real" else f"engine_process_cpu_{engine}.json")


def main(engine: str) -> None:
    rows = [
        {**_child(engine, flag), "round": k}
        for k in range(1, ROUNDS + 1)
        for flag in ((False, True) if k % 2 else (True, False))
    ]
    _out(engine).write_text(json.dumps({"machine": f"{os.cpu_count()} CPU cores", "rows": rows}, indent=1))
    for r in rows:
        print(
            f"round {r['round']} engine_process={r['engine_process']!s:5} {r['tok_s']:8.1f} tok/s  "
            f"TTFT p50 {r['ttft_p50']} s  TPOT p50 {r['tpot_p50']} s  CPU s per 1k tokens {r['cpu_s_per_1k_tokens']}"
        )
    plot(engine)


def plot(engine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    data = json.loads(_out(engine).read_text())
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(
        [f"{'engine process' if r['engine_process'] else 'in-process'}\nround {r['round']}" for r in rows],
        [r["tok_s"] for r in rows],
        color=["#2a7" if r["engine_process"] else "#999" for r in rows],
    )
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['tok_s']:.1f} tok/s\n{r['requests']} requests",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens/s delivered")
    ax.set_ylim(0, max(r["tok_s"] for r in rows) * 1.3)
    title = f"{rows[0]['clients']} streaming clients, {engine} engine ({data['machine']})"
    save_figure(fig, title, _out(engine).with_suffix(".png"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=sorted(SETUP), default="real")
    p.add_argument("--variant", choices=["in", "process"])
    p.add_argument("--out")
    p.add_argument("--plot-only", action="store_true")
    a = p.parse_args()
    if a.variant:
        pathlib.Path(a.out).write_text(json.dumps(run_variant(a.engine, a.variant == "process")))
    elif a.plot_only:
        plot(a.engine)
    else:
        main(a.engine)
