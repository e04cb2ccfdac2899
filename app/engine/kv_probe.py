"""Measure, on the GPU, what the KV sizing rule (app/engine/kv_sizing.py) needs: the device's
total, what is used once the weights and adapter slots are in, and the engine's workspace.

The KV must exist before the decode graphs are captured (they hold its addresses), so its size
cannot wait for the capture. Instead a probe engine with a small KV cache is built first, as
vLLM profiles a dummy forward: it compiles and loads the kernels, captures the graphs and runs
one step of max_tokens_per_step prompt tokens over max_batch_size requests (sampled with top-p,
top-k, penalties and logprobs, the sampler's largest buffers), then its decode steps. The peak
it reserves beyond its own KV is the workspace; once it is gone, what the device still holds
(weights, slots, loaded kernels, CUDA context, other processes) is ``used``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from app.engine.config import EngineConfig
from app.engine.scheduler import blocks_for
from app.protocol import GenerateRequest, SamplingParams

_DECODE_STEPS = 3  # tokens each probe request generates: its prefill, then decode steps (graph replays)


@dataclass(frozen=True)
class Measurement:
    total: int  # the device's memory, bytes
    used: int  # held once the probe is gone (by anyone)
    workspace: int  # the probe's peak reserved memory beyond its KV and what stays after it
    seconds: float


def probe_rows(config: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """(requests, prompt tokens each) of the probe's step: max_tokens_per_step tokens over up to
    max_batch_size requests, each prompt short enough to generate its tokens within max_model_len."""
    rows = max(1, min(config.max_num_seqs, config.max_tokens_per_step))
    per = max(1, min(config.max_tokens_per_step // rows, max_model_len - _DECODE_STEPS))
    return rows, per


def probe_config(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """The probe engine's config: the serving one with just enough KV for its requests."""
    rows, per = probe_rows(config, max_model_len)
    blocks = rows * blocks_for(per + _DECODE_STEPS, config.block_size)
    return replace(config, num_kv_blocks=blocks, prefix_caching=False)


def exercise(core, config: EngineConfig, vocab_size: int, max_model_len: int) -> None:
    """Run the probe's requests to the end: one full prefill step, then decode steps."""
    rows, per = probe_rows(config, max_model_len)
    params = SamplingParams(
        max_tokens=_DECODE_STEPS,
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        seed=0,
        logprobs=20,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        ignore_eos=True,
    )
    for i in range(rows):
        ids = tuple((i * per + j) % vocab_size for j in range(per))
        core.add(GenerateRequest(f"kv-probe-{i}", ids, params))
    for _ in range(rows * (per + _DECODE_STEPS) + 8):  # bounded: each step computes at least one token
        if not core.has_work():
            break
        core.step()


def measure(model, adapters, tokenizer, config: EngineConfig, max_model_len: int) -> Measurement:
    """Build and run a probe engine on ``config.device``; its memory is returned to the device after."""
    from app.engine.core import EngineCore

    device = torch.device(config.device)
    start = time.perf_counter()
    _release(device)
    torch.cuda.reset_peak_memory_stats(device)
    core = EngineCore(model, adapters, tokenizer, probe_config(config, max_model_len))
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in core.kv)
    exercise(core, config, model.cfg.vocab_size, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    core.runner.graphs = None  # the graphs' private memory pool goes with them
    del core
    _release(device)
    kept = torch.cuda.memory_reserved(device)  # weights, slots, the kernels' persistent buffers
    free, total = torch.cuda.mem_get_info(device)
    return Measurement(total, total - free, max(peak - kept - kv_bytes, 0), time.perf_counter() - start)


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
