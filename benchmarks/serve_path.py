"""The served path's own ceiling on this machine: tokens/s delivered to 64 streaming HTTP
clients by one LoraReplica whose engine computes nothing (benchmarks/simulated_engine.py: the
real scheduler, a step that sleeps STEP_S, " <id>" per token), through the real Ingress,
Serve's proxy and HTTP; before (BASE, run from a temporary `git worktree`) and after (this
tree), in one invocation.

    python -m benchmarks.serve_path              # ~4 × 60 s
    python -m benchmarks.serve_path --plot-only
    python -m benchmarks.serve_path --profile    # one round each under py-spy → serve_path_profile.json

Each variant runs in its own process with PYTHONPATH at its tree (Ray workers inherit it).
Clients are closed-loop (benchmarks/sse_load.py): each keeps one streaming /v1/completions
request of MAX_TOKENS in flight. The engine alone could give CLIENTS / STEP_S tokens/s: the
path, not the engine, is what is measured. ROUNDS alternate before/after, as the machine's
other load comes and goes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: a variant's `app` comes from its own tree
from benchmarks.sse_load import completion_body, http_client, summarize  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "serve_path.json"
OUT_PROFILE = OUT.with_name("serve_path_profile.json")
BASE = "29a69bf"  # the commit before coalesced streams
CLIENTS, MAX_TOKENS, STEP_S = 64, 128, 0.002
WARMUP_S, MEASURE_S, ROUNDS = 5.0, 15.0, 2


# -- one variant (a child process, PYTHONPATH at its tree) -------------------------------

PROCESSES = {"replica": "ServeReplica:path:LoraReplica", "ingress": "ServeReplica:path:Ingress", "proxy": "ProxyActor"}


def _pids() -> dict[str, str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return {
        name: pid
        for name, marker in PROCESSES.items()
        for pid in [next((line.split()[0] for line in ps if marker in line), None)]
        if pid
    }


def _cpu_seconds(pids: dict[str, str]) -> dict[str, float]:
    """user + system CPU seconds each process has used so far (/proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _profile(dest: pathlib.Path, seconds: float) -> list[subprocess.Popen]:
    """py-spy (pip install py-spy) on the replica, the Ingress and the proxy for ``seconds``."""
    dest.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in _pids().items():
        procs.append(
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-d",
                    str(int(seconds)),
                    "-r",
                    "50",
                    "-f",
                    "raw",
                    "-o",
                    str(dest / f"{name}.txt"),
                    "-p",
                    pid,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def top_frames(raw: pathlib.Path, n: int = 12) -> dict:
    """Samples, and the functions most samples were in (self time, as shares of the samples)."""
    own, total = {}, 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        name, _, where = leaf.partition(" (")
        key = f"{name} ({pathlib.Path(where.split(':')[0]).name})"
        own[key] = own.get(key, 0) + int(count)
        total += int(count)
    return {
        "samples": total,
        "self": [(f, round(c / total, 3)) for f, c in sorted(own.items(), key=lambda x: -x[1])[:n]],
    }


def run_variant(label: str, profile: pathlib.Path | None) -> dict:
    import functools

    import ray
    import yaml
    from ray import serve

    from app.builder import app_from_args
    from benchmarks.simulated_engine import StepTime, simulated_engine

    args = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    args.update(
        model_name="base",
        max_batch_size=CLIENTS,
        num_kv_blocks=2048,
        block_size=16,
        adapter_dirs=[],
        replica={"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
    )
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = 18000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_from_args(args, functools.partial(simulated_engine, StepTime(STEP_S))), name="path", route_prefix="/")
    records: list = []
    t0 = time.monotonic() + WARMUP_S
    body = itertools.repeat(completion_body([11, 22, 33, 44], MAX_TOKENS, "base"))

    cpu: dict[str, float] = {}

    async def load():
        clients = asyncio.gather(*(http_client(port, body, t0 + MEASURE_S, records) for _ in range(CLIENTS)))
        await asyncio.sleep(WARMUP_S)
        pids = _pids()
        spies = _profile(profile, MEASURE_S - 2) if profile else []
        start = _cpu_seconds(pids)
        await asyncio.sleep(MEASURE_S)
        cpu.update({k: v - start[k] for k, v in _cpu_seconds(pids).items()})
        await clients
        return spies

    for spy in asyncio.run(load()):
        spy.wait()
    serve.shutdown()
    ray.shutdown()
    import app

    return {
        "variant": label,
        "app": str(pathlib.Path(app.__file__).parent),
        "clients": CLIENTS,
        "step_s": STEP_S,
        "engine_ceiling_tok_s": CLIENTS / STEP_S,
        **(summary := summarize(records, t0, t0 + MEASURE_S)),
        # CPU seconds each process used per 1,000 tokens delivered in the measured window
        "cpu_s_per_1k_tokens": {k: round(v / (summary["tok_s"] * MEASURE_S / 1000), 3) for k, v in cpu.items()},
        "profile": {f.stem: top_frames(f) for f in sorted(profile.glob("*.txt"))} if profile else None,
    }


# -- the two variants, and the figure ------------------------------------------------------


def _child(tree: pathlib.Path, label: str, profile: bool) -> dict:
    out = pathlib.Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_USAGE_STATS_ENABLED": "0"}
    spy = ["--profile", tempfile.mkdtemp()] if profile else []
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serve_path.py"), "--variant", label, "--out", str(out), *spy],
        env=env,
        check=True,
        cwd=tree,
    )
    return json.loads(out.read_text())


def main(profile: bool) -> None:
    """profile: one round, each variant under py-spy (replica, Ingress, proxy), to OUT_PROFILE."""
    base = pathlib.Path(tempfile.mkdtemp()) / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), BASE], check=True)
    try:
        rows = [
            {**_child(tree, label, profile), "round": k}
            for k in range(1, 1 + (1 if profile else ROUNDS))
            for tree, label in ((base, f"before ({BASE})"), (REPO, "after"))
        ]
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)
    (OUT_PROFILE if profile else OUT).write_text(
        json.dumps(
            {"machine": f"{os.cpu_count()} CPU cores", "max_tokens": MAX_TOKENS, "measure_s": MEASURE_S, "rows": rows},
            indent=1,
        )
    )
    if not profile:
        plot()


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    data = json.loads(OUT.read_text())
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(
        [f"{r['variant']}\nround {r['round']}" for r in rows],
        [r["tok_s"] for r in rows],
        color=["#999" if r["variant"].startswith("before") else "#2a7" for r in rows],
    )
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['tok_s']:.0f} tok/s\n{r['tokens_per_event']:.1f} tok/event",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens/s delivered")
    ax.set_ylim(0, max(r["tok_s"] for r in rows) * 1.3)
    save_figure(fig, f"{CLIENTS} streaming clients, simulated engine ({data['machine']})", OUT.with_suffix(".png"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--out")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--profile", nargs="?", const="", help="py-spy the path (needs `pip install py-spy`)")
    a = p.parse_args()
    if a.variant:
        pathlib.Path(a.out).write_text(
            json.dumps(run_variant(a.variant, pathlib.Path(a.profile) if a.profile else None))
        )
    elif a.plot_only:
        plot()
    else:
        main(a.profile is not None)
