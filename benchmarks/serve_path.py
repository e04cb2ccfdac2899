"""The served path's own ceiling on this machine: tokens/s delivered to 64 streaming HTTP
clients by one LoraReplica whose engine computes nothing (app/engine/simulated.py: the
real scheduler, a step that sleeps STEP_S, " <id>" per token), through the real Ingress,
Serve's proxy and HTTP; before (BASE, run from a temporary `git worktree`) and after (this
tree), in one invocation.

    python benchmarks/serve_path.py              # ~2 × 100 s
    python benchmarks/serve_path.py --plot-only

Each variant runs in its own process with PYTHONPATH at its tree (Ray workers inherit it).
Clients are closed-loop: each keeps one streaming /v1/completions request of MAX_TOKENS
in flight; a raw asyncio HTTP/1.1 client counts the tokens each SSE event carries (an event
may carry several). The engine alone could give CLIENTS / STEP_S tokens/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "serve_path.json"
BASE = "29a69bf"  # the commit before coalesced streams
CLIENTS, MAX_TOKENS, STEP_S = 64, 128, 0.002
WARMUP_S, MEASURE_S = 8.0, 20.0


# -- one variant (a child process, PYTHONPATH at its tree) -------------------------------

async def _client(port: int, deadline: list[float], stats: dict) -> None:
    body = json.dumps({"model": "base", "prompt": [11, 22, 33, 44], "max_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 0.0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.monotonic() < deadline[0]:
        writer.write(head + body)
        start, first = time.monotonic(), None
        while True:
            line = await reader.readline()  # chunked framing lines and SSE lines alike
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                text = json.loads(line[6:])["choices"][0]["text"]
                if time.monotonic() >= deadline[1]:
                    stats["tokens"] += text.count(" ")
                    stats["events"] += 1
                if first is None and text:
                    first = time.monotonic() - start
        while (await reader.readline()) not in (b"0\r\n", b""):  # the chunked body's end
            pass
        await reader.readline()
        stats["ttft"].append(first)
    writer.close()


def run_variant(label: str) -> dict:
    import functools

    import ray
    import yaml
    from ray import serve

    from app.builder import app_from_args
    from app.engine.simulated import StepTime, simulated_engine

    args = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    args.update(model_name="base", max_batch_size=CLIENTS, num_kv_blocks=2048, block_size=16, adapter_dirs=[],
                replica={"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}})
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = 18000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_from_args(args, functools.partial(simulated_engine, StepTime(STEP_S))), name="path", route_prefix="/")
    stats = {"tokens": 0, "events": 0, "ttft": []}
    now = time.monotonic()
    deadline = [now + WARMUP_S + MEASURE_S, now + WARMUP_S]

    async def load():
        await asyncio.gather(*(_client(port, deadline, stats) for _ in range(CLIENTS)))

    asyncio.run(load())
    serve.shutdown()
    ray.shutdown()
    ttft = sorted(t for t in stats["ttft"] if t is not None)
    return {"variant": label, "clients": CLIENTS, "step_s": STEP_S, "tok_s": stats["tokens"] / MEASURE_S,
            "events_s": stats["events"] / MEASURE_S, "tokens_per_event": stats["tokens"] / max(stats["events"], 1),
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "engine_ceiling_tok_s": CLIENTS / STEP_S}


# -- the two variants, and the figure ------------------------------------------------------

def _child(tree: pathlib.Path, label: str) -> dict:
    out = pathlib.Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_path.py"), "--variant", label, "--out", str(out)],
                   env=env, check=True, cwd=tree)
    return json.loads(out.read_text())


def main() -> None:
    base = pathlib.Path(tempfile.mkdtemp()) / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), BASE], check=True)
    try:
        rows = [_child(base, f"before ({BASE})"), _child(REPO, "after")]
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)
    OUT.write_text(json.dumps({"machine": f"{os.cpu_count()} CPU cores", "max_tokens": MAX_TOKENS,
                               "measure_s": MEASURE_S, "rows": rows}, indent=1))
    plot()


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(REPO))
    from benchmarks.method import save_figure

    data = json.loads(OUT.read_text())
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r["variant"] for r in rows], [r["tok_s"] for r in rows], color=["#999", "#2a7"])
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['tok_s']:.0f} tok/s\n{r['tokens_per_event']:.1f} tok/event", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s delivered")
    ax.set_ylim(0, max(r["tok_s"] for r in rows) * 1.3)
    save_figure(fig, f"{CLIENTS} streaming clients, simulated engine ({data['machine']})", OUT.with_suffix(".png"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--out")
    p.add_argument("--plot-only", action="store_true")
    a = p.parse_args()
    if a.variant:
        pathlib.Path(a.out).write_text(json.dumps(run_variant(a.variant)))
    elif a.plot_only:
        plot()
    else:
        main()
