"""`vllm bench serve`'s workload and report, for benchmarks/serve_bench.py.

Requests: vLLM's random dataset (exactly ``input_len`` random prompt token ids, exactly
``output_len`` new tokens), or a chat-like mix (prompt and output lengths lognormal, clipped).
Arrivals as vLLM sends them: all at once (rate inf) or Poisson at ``rate`` requests/s, each
request waiting for a slot when ``max_concurrency`` is set; a request's clock starts when it
is sent (after its slot). The report is vLLM's: request, output and total token throughput
over the whole run, and mean / median / p99 of TTFT, TPOT (per request: (latency - TTFT) /
(output tokens - 1)) and ITL (the gap between two consecutive streamed items of a request,
as vLLM measures it per received chunk), in milliseconds. Rows merge into one JSON per GPU,
with a PNG of output tokens/s per scenario, engine beside http.
"""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# What makes a JSON row one measurement (with its shape): a new run replaces the row it repeats
KEY = ("path", "workload", "adapters", "input_len", "output_len", "concurrency", "request_rate")
# Chat-like lengths: lognormal (median, sigma) clipped to [lo, hi]
CHAT_PROMPT = (180, 0.9, 16, 1536)
CHAT_OUTPUT = (110, 0.8, 8, 512)


@dataclass(frozen=True)
class Req:
    index: int
    prompt: tuple[int, ...]
    output_len: int
    adapter: str | None  # None: the base model


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    items: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _adapter(i: int, adapters: int) -> str | None:
    return f"a{i % adapters}" if adapters else None  # round-robin, as the table was measured


def random_requests(n: int, input_len: int, output_len: int, vocab: int, adapters: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req(i, tuple(rng.randrange(vocab) for _ in range(input_len)), output_len, _adapter(i, adapters))
        for i in range(n)
    ]


def _lognormal(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    median, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def chat_requests(n: int, vocab: int, adapters: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len, output_len = _lognormal(rng, CHAT_PROMPT), _lognormal(rng, CHAT_OUTPUT)
        out.append(Req(i, tuple(rng.randrange(vocab) for _ in range(prompt_len)), output_len, _adapter(i, adapters)))
    return out


async def drive(
    requests: list[Req],
    send: Callable[[Req], Awaitable[Outcome]],
    rate: float,
    max_concurrency: int | None,
    seed: int,
) -> tuple[list[Outcome], float]:
    """Send every request (Poisson gaps at ``rate``, none at inf); (outcomes in order, duration s)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    gaps = random.Random(seed + 1)

    async def one(req: Req) -> Outcome:
        if slots is None:
            return await send(req)
        async with slots:
            return await send(req)

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if not math.isinf(rate):
            await asyncio.sleep(gaps.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.perf_counter() - start


def _stats(name: str, values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return {f"{name}_mean_ms": None, f"{name}_median_ms": None, f"{name}_p99_ms": None}
    mid = len(ms) // 2
    median = ms[mid] if len(ms) % 2 else (ms[mid - 1] + ms[mid]) / 2
    p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return {f"{name}_mean_ms": sum(ms) / len(ms), f"{name}_median_ms": median, f"{name}_p99_ms": p99}


def metrics(requests: list[Req], outcomes: list[Outcome], duration: float) -> dict:
    done = [(r, o) for r, o in zip(requests, outcomes) if o.ok]
    inputs = sum(len(r.prompt) for r, _ in done)
    outputs = sum(o.output_tokens for _, o in done)
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for _, o in done if o.output_tokens > 1]
    failed = [o.error for o in outcomes if not o.ok]
    return {
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(done) / duration,
        "output_tok_s": outputs / duration,
        "total_tok_s": (inputs + outputs) / duration,
        "tokens_per_item": outputs / max(1, sum(o.items for _, o in done)),
        **_stats("ttft", [o.ttft for _, o in done]),
        **_stats("tpot", tpot),
        **_stats("itl", [g for _, o in done for g in o.itl]),
    }


def report(title: str, m: dict) -> str:
    """vLLM's printout of one run."""

    def num(label, value, fmt=".2f"):
        return f"{label:<40} {'-' if value is None else format(value, fmt):<10}"

    lines = [
        f"{' ' + title + ' ':=^50}",
        num("Successful requests:", m["completed"], "d"),
        num("Failed requests:", m["failed"], "d"),
        num("Benchmark duration (s):", m["duration_s"]),
        num("Total input tokens:", m["total_input_tokens"], "d"),
        num("Total generated tokens:", m["total_output_tokens"], "d"),
        num("Request throughput (req/s):", m["request_throughput"]),
        num("Output token throughput (tok/s):", m["output_tok_s"]),
        num("Total Token throughput (tok/s):", m["total_tok_s"]),
    ]
    for key, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)")):
        lines.append(f"{head:-^50}")
        lines += [num(f"{s.title()} {key.upper()} (ms):", m[f"{key}_{s}_ms"]) for s in ("mean", "median", "p99")]
    lines.append(f"{'Inter-token Latency':-^50}")
    lines += [num(f"{s.title()} ITL (ms):", m[f"itl_{s}_ms"]) for s in ("mean", "median", "p99")]
    lines.append("=" * 50)
    if m["first_error"]:
        lines.append(f"first error: {m['first_error']}")
    return "\n".join(lines)


def save(out: pathlib.Path, rows: list[dict], meta: dict) -> None:
    """Merge rows into out: a row with the same key (and shape) replaces the old one."""
    data = json.loads(out.read_text()) if out.exists() else {"rows": []}
    key = lambda r: tuple(r.get(k) for k in (*KEY, "shape"))  # noqa: E731
    fresh = {key(r) for r in rows}
    data["rows"] = [r for r in data["rows"] if key(r) not in fresh] + rows
    data.update(meta)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out}", flush=True)


def plot(out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    rows = json.loads(out.read_text())["rows"]
    labels = sorted(
        {(r["shape"], r["workload"], r["adapters"], str(r["concurrency"]), str(r["request_rate"])) for r in rows}
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    for k, path in enumerate(("engine", "http")):
        by = {
            (r["shape"], r["workload"], r["adapters"], str(r["concurrency"]), str(r["request_rate"])): r for r in rows
        }
        by = {lab: r for lab, r in by.items() if r["path"] == path}
        values = [by[lab]["output_tok_s"] if lab in by else 0 for lab in labels]
        ax.bar([i + 0.4 * k for i in range(len(labels))], values, 0.4, label=path)
    names = [f"{s}\n{w} a={n}\nc={c} r={rate}" for s, w, n, c, rate in labels]
    ax.set_xticks([i + 0.2 for i in range(len(labels))], names, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.legend()
    save_figure(fig, "vllm bench serve's workload: engine alone vs over HTTP", out.with_suffix(".png"))
