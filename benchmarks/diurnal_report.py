"""The diurnal trace's numbers (benchmarks/diurnal_trace.py, diurnal_trace_gpu.py): one arm's
summary from its request records and replica samples, the loraplex arm's summary against
Ray's defaults with the issue's targets, and the figure."""

from __future__ import annotations

import pathlib

import numpy as np

from benchmarks.method import save_figure

# issue 50: replica-seconds ≤ 0.6× Ray's defaults, ≥ 80 % of replica-time at batch 0 or full,
# TTFT p99 ≤ 2× Ray's defaults, nothing cut by a release, nothing lost
TARGETS = {"replica_seconds_ratio": 0.6, "batch0_or_full_fraction": 0.8, "ttft_p99_ratio": 2.0}


def summarize(records, rows, start, max_batch, step: dict | None, busy_releases: int | None = None) -> dict:
    """records: per request (arrival, token times, ok, moves, move reasons); rows: (t, replica →
    running, −1 while not reporting) every sampling period; step: the modeled step (None: real)."""
    ts = np.array([t - start for t, _ in rows])
    counts = np.array([len(r) for _, r in rows])
    dt = np.diff(ts, append=ts[-1])
    batches = [b for _, r in rows for b in r.values() if b >= 0]
    replica_time = [(d, b) for (_, r), d in zip(rows, dt) for b in r.values() if b >= 0]
    total = sum(d for d, _ in replica_time) or 1.0
    share = lambda ok: sum(d for d, b in replica_time if ok(b)) / total  # noqa: E731
    ttft = [r["times"][0] - r["arrival"] for r in records if r["times"]]
    tbt = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    busy = [b for b in batches if b > 0]
    # did the replicas keep the step-time model on this machine? a token per step, so the
    # median gap between tokens should be the modeled decode step at the typical batch
    modeled = step["base_s"] + step["per_request_s"] * float(np.median(busy)) if busy and step else None
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    alive = float(np.sum(counts * dt))
    return {
        "requests": len(records),
        "lost": sum(not r["ok"] for r in records),
        "replica_seconds": alive,
        # replica-time while a replica is alive but not serving yet (starting) is in neither share
        "share_starting": 1 - total / alive if alive else 0.0,
        "share_batch_0_or_max": share(lambda b: b == 0 or b >= max_batch),
        "share_batch_0": share(lambda b: b == 0),
        "share_batch_max": share(lambda b: b >= max_batch),
        "share_batch_max_minus_1": share(lambda b: b == max_batch - 1),
        "share_batch_between": share(lambda b: 0 < b < max_batch),
        "p50_ttft_s": pct(ttft, 50),
        "p99_ttft_s": pct(ttft, 99),
        "p50_tbt_s": pct(tbt, 50),
        "p99_tbt_s": pct(tbt, 99),
        "modeled_step_s": modeled,
        "p50_tbt_over_model": pct(tbt, 50) / modeled if modeled and tbt else None,
        "migrations": sum(r["moves"] for r in records),
        "moved_off_stopped_replica": sum(reason == "replica_stopped" for r in records for reason in r["reasons"]),
        "busy_releases": busy_releases,
        "scale_events": int(np.count_nonzero(np.diff(counts))),
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


def against_default(ours: dict, default: dict) -> dict:
    """The loraplex arm against Ray's defaults, with the targets and whether each is met."""
    ttft = ours["p99_ttft_s"] / default["p99_ttft_s"] if ours["p99_ttft_s"] and default["p99_ttft_s"] else None
    s = {
        "replica_seconds_ratio": float(ours["replica_seconds"] / default["replica_seconds"]),
        "batch0_or_full_fraction": ours["share_batch_0_or_max"],
        "ttft_p99_ratio": ttft,
        "busy_releases": ours["busy_releases"],
        "lost": ours["lost"],
    }
    s["met"] = {
        "replica_seconds_ratio": bool(s["replica_seconds_ratio"] <= TARGETS["replica_seconds_ratio"]),
        "batch0_or_full_fraction": bool(s["batch0_or_full_fraction"] >= TARGETS["batch0_or_full_fraction"]),
        "ttft_p99_ratio": bool(ttft is not None and ttft <= TARGETS["ttft_p99_ratio"]),
        "busy_releases": s["busy_releases"] == 0,
        "lost": s["lost"] == 0,
    }
    return s


def plot(trace: dict, title: str, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    colors = iter(["tab:gray", "tab:blue", "tab:orange", "tab:green"])
    for name, arm in trace["arms"].items():
        r, color = arm["timeline"], next(colors)
        end = max(r["t"]) if r["t"] else 1
        bins = np.arange(0, end + 5, 5)
        w = [1 / 5] * len(r["arrivals"])
        axes[0].hist(r["arrivals"], bins=bins, histtype="step", color=color, weights=w, label=f"{name}: requests/s")
        axes[0].step(r["t"], r["replicas"], where="post", color=color, linestyle="--", label=f"{name}: replicas")
        w = [1 / 5] * len(r["tokens"])
        axes[1].hist(r["tokens"], bins=bins, histtype="step", color=color, weights=w, label=name)
        for k in sorted({k for row in r["batches"] for k in row}):
            ys = [row.get(k, np.nan) if row.get(k, -1) >= 0 else np.nan for row in r["batches"]]
            axes[2].plot(r["t"], ys, color=color, alpha=0.6, linewidth=0.8)
    axes[0].set_ylabel("requests/s, replicas")
    axes[1].set_ylabel("tokens/s")
    axes[2].set_ylabel("batch per replica")
    axes[2].set_xlabel("seconds into the trace")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    save_figure(fig, title, path)
