"""The timing method and plot style every SGMV benchmark shares (benchmarks/sgmv.py's method):
one CUDA graph replayed behind an L2 flush, median of CUDA-event timings; log-log latency
against batch size."""

import numpy as np
import torch

REPS = 100  # replays per figure


def time_graph(fn, flush, reps=REPS):
    """Median µs of one replay of `fn` captured as a graph, L2 flushed before each replay:
    `flush` is the tensor zeroed (the method), or a callable that flushes otherwise."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush() if callable(flush) else flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * float(np.median([s.elapsed_time(e) for s, e in events]))


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second (after a warm-up that lifts the clocks)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB; torch.neg is an SM kernel, copy_ a DMA copy
    dst = torch.empty_like(src)
    for _ in range(50):
        torch.neg(src, out=dst)
    us = time_graph(lambda: torch.neg(src, out=dst), torch.empty(0, device="cuda"), reps=50)
    return 2 * 4 * src.numel() / (us * 1e-6)


def latency_axes(ax, title, batches, ylabel, xlabel):
    """Log-log latency against batch size, as every SGMV plot draws it (labels on the edges only)."""
    ax.set(xscale="log", yscale="log", title=title, xticks=batches)
    ax.set_xticklabels(batches)
    ax.grid(True, which="both", alpha=0.3)
    if ylabel:
        ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel("batch size")


def save_figure(fig, title, png):
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
