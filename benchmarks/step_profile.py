"""Where a full-batch decode step's time goes: wall time per step without a profiler, then the
GPU time per kernel category (attention / GEMMs / LoRA / other) from a torch profile of as many
steps. Wall minus the categories' sum is time the GPU waits (host work not hidden, launch gaps)."""

import time

import torch

CATEGORIES = ("attention", "gemm", "lora", "other")


def _category(name: str) -> str:
    name = name.lower()
    if "paged_decode" in name or "flash" in name:
        return "attention"
    if "sgmv" in name:
        return "lora"
    if any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    return "other"


def _steps(engine, n):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def _until_all_decode(engine, batch, timeout_s=60.0):
    """Step until every request decodes (adapter copies, prefill done), then two steps more."""
    deadline = time.monotonic() + timeout_s
    while not (engine.last_batch_size == batch and all(s.num_uncomputed == 1 for s in engine.scheduler.running)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{batch} requests not all decoding after {timeout_s} s")
        engine.step()
    _steps(engine, 2)


def profile_breakdown(engine, pool_adapters, workload, which, rng, steps=10):
    """Per-step wall and per-category GPU ms of decode steps of the requests of `workload`;
    which: each request's adapter index (None: the base model)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from app.protocol import GenerateRequest, SamplingParams

    for i, a in enumerate(which):
        req = GenerateRequest(
            f"p{workload}{i}",
            tuple(rng.randrange(32000) for _ in range(128)),
            SamplingParams(max_tokens=64, temperature=0.0),
            None if a is None else f"a{a}",
        )
        engine.add(req, adapter=None if a is None else pool_adapters[a])
    _until_all_decode(engine, len(which))
    wall = _steps(engine, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _steps(engine, steps)
    while engine.has_work():
        engine.step()
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # kernels and copies only
            cats[_category(e.name)] += e.device_time_total / 1e3 / steps
    return {
        "workload": workload,
        "max_batch": len(which),
        "step_wall_ms": 1e3 * wall,
        **{f"{k}_ms": v for k, v in cats.items()},
    }
