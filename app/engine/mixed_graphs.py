"""Steps that carry prefills as piecewise CUDA graphs: everything but attention replayed, attention
run eagerly between the pieces.

A forward's work splits at its attention calls. What lies between two of them (norms, GEMMs, the LoRA
add-on, RoPE + KV write, SwiGLU, the LM head) depends on the step's token count only; attention
depends on each request's lengths. So for each token bucket the forward is captured as layers + 1
graphs, cut where the model calls attention (ops/attention.split_at_attention: the model is unchanged),
and a step replays them in turn with its attention run eagerly in between, as an eager step runs it
(the prefill rows' FlashAttention varlen, the decode rows' paged kernel). q leaves a piece, and
attention's output enters the next one, through two buffers shared by every bucket and layer (one copy
each way, inside the graphs), the logits through a third; so the graphs' private memory is one
bucket's working set, not the sum over buckets.

Padding makes every shape a function of the bucket alone: rows past the step's tokens have token 0,
position 0 and KV slot −1 (nothing written) and form a LoRA run with slot −1; every op between two
attention calls is row-wise, so no real row reads a padded one. LoRA segments are always max_rows + 1
(the step's runs of one adapter, the padding run, then empty ones) and sampled rows always max_rows
(the extra ones read row 0), so the SGMV kernel, its grid and the LM head's shape never depend on the
step. `pick` (the bucket of a step) is a pure function of the step's token count.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from app.engine.batch import attention_rows, step_rows
from app.engine.staging_buffer import StagingBuffer
from app.model.inputs import LoraSegments, StepInputs
from ops.attention import paged_attention, split_at_attention
from ops.paged_attention import PagedBatch

log = logging.getLogger(__name__)


def token_buckets(limit: int) -> list[int]:
    """Token counts pieces are captured for: multiples of 64 up to 512, then of 128, up to `limit`
    (which is one). Past a few hundred tokens a step is bound by its GEMMs' FLOPs, so padding costs
    what it adds to them: at most 127 of ≥ 512 tokens."""
    out = list(range(64, min(limit, 512) + 1, 64)) + list(range(640, limit + 1, 128))
    if not out or out[-1] < limit:
        out.append(limit)
    return out


def pick(tokens: int, buckets: list[int]) -> int | None:
    """The bucket a step of `tokens` rows replays: the smallest that holds it (None: past the
    largest, the step runs eagerly)."""
    return next((b for b in buckets if b >= tokens), None)


def fill_host(h: dict, t: int, rows, has_module: dict) -> bool:
    """Write one step into the host arrays `h` of bucket `t` (views sized for the largest bucket);
    rows: (order, token ids, positions, KV slots, rows sampled) as batch.step_rows gives them;
    has_module: module → per pool slot, whether the adapter there has it. Returns whether any row
    uses an adapter."""
    order, tokens, positions, slots, sample = rows
    n, k = len(tokens), len(sample)
    h["tokens"][:n], h["tokens"][n:t] = tokens, 0
    h["positions"][:n], h["positions"][n:t] = positions, 0
    h["slots"][:n], h["slots"][n:t] = slots, -1
    h["sample"][:k], h["sample"][k:] = sample, 0
    runs: list[list[int]] = []  # [slot, rows]
    for seq, m in order:
        if runs and runs[-1][0] == seq.lora_slot:
            runs[-1][1] += m
        else:
            runs.append([seq.lora_slot, m])
    if n < t:
        runs.append([-1, t - n])
    bounds = np.cumsum([0] + [r for _, r in runs])
    h["indptr"][: len(bounds)], h["indptr"][len(bounds) :] = bounds, t
    ids = np.array([s for s, _ in runs])
    for j, has in enumerate(has_module.values()):
        h["slot_ids"][j, : len(runs)] = np.where((ids >= 0) & has[np.maximum(ids, 0)], ids, -1)
        h["slot_ids"][j, len(runs) :] = -1
    return bool((ids >= 0).any())


class _Static:
    """Every bucket's inputs, in one staging buffer sized for the largest bucket
    (app/engine/staging_buffer.py), copied in one transfer per step."""

    def __init__(self, tokens: int, rows: int, modules: list[str], device):
        self.modules, segs = modules, rows + 1
        parts = {"tokens": tokens, "positions": tokens, "slots": tokens, "sample": rows}
        parts.update(indptr=segs + 1, slot_ids=(len(modules), segs))
        self.staging = StagingBuffer(parts, device)
        self.dev, self.host = self.staging.dev, self.staging.host

    def inputs(self, t: int, lora: bool) -> StepInputs:
        """Bucket t's StepInputs (build them inside a capture: sample_rows is an op on the buffer)."""
        d = self.dev
        segs = LoraSegments(d["indptr"], {m: d["slot_ids"][j] for j, m in enumerate(self.modules)}, None)
        return StepInputs(
            d["tokens"][:t],
            d["positions"][:t],
            d["slots"][:t],
            PagedBatch(None, None),
            d["sample"].long(),
            segs if lora else None,
        )

    def fill(self, t: int, rows, has_module: dict) -> bool:
        self.staging.wait_sent()
        lora = fill_host(self.host, t, rows, has_module)
        self.staging.send()
        return lora

    def fill_idle(self, t: int) -> None:
        """Inputs that touch nothing: no KV written, no LoRA rows."""
        h = self.host
        h["tokens"][:], h["positions"][:], h["slots"][:], h["sample"][:] = 0, 0, -1, 0
        h["indptr"][:], h["slot_ids"][:] = 0, -1
        self.staging.send_now()


class MixedGraphs:
    """Captured pieces of the forward for every token bucket up to max_tokens; `run` replays one."""

    def __init__(self, model, kv, max_rows: int, max_tokens: int, block_size: int, device):
        self.model, self.kv, self.block_size, self.device = model, kv, block_size, device
        pool = model.lora_pool
        self.pool = pool
        self.buckets = token_buckets(max_tokens)
        self.max_rows = max_rows
        self.static = _Static(self.buckets[-1], max_rows, list(pool.has_module) if pool is not None else [], device)
        self.q = self.o = self.logits = None  # the buffers between pieces: made by the first warm-up
        self._stream = torch.cuda.Stream(device)
        self._pieces: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self._calls: list[tuple] = []  # each attention call's (k_cache, v_cache, scale, window, softcap)
        mempool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        for t in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            for lora in (False, True) if pool is not None else (False,):
                self._pieces[(t, lora)] = self._capture(t, lora, mempool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured mixed-step pieces for %d token buckets in %.2f s", len(self.buckets), self.capture_seconds)

    def _buffers(self, out, q, k_cache, v_cache, batch, scale, window, softcap):
        """The warm-up's attention: make the buffers between pieces (plain tensors, not the graphs')."""
        if self.q is None:
            with torch.inference_mode(False):
                self.q = torch.empty(self.buckets[-1], *q.shape[1:], dtype=q.dtype, device=q.device)
                self.o = torch.empty_like(self.q)
        return out

    def _capture(self, t: int, lora: bool, mempool) -> list[torch.cuda.CUDAGraph]:
        self.static.fill_idle(t)
        with torch.inference_mode(), split_at_attention(self._buffers):  # kernels loaded, cuBLAS workspaces made
            logits = self.model.forward(self.static.inputs(t, lora), self.kv)
        if self.logits is None:
            with torch.inference_mode(False):
                self.logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        del logits
        torch.cuda.synchronize()
        pieces, calls, graph = [], [], [torch.cuda.CUDAGraph()]

        def split(out, q, k_cache, v_cache, batch, scale, window, softcap):
            self.q[:t].copy_(q)
            graph[0].capture_end()
            pieces.append(graph[0])
            calls.append((k_cache, v_cache, scale, window, softcap))
            graph[0] = torch.cuda.CUDAGraph()
            graph[0].capture_begin(pool=mempool)
            out.copy_(self.o[:t])
            return out

        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(self._stream), split_at_attention(split):
            graph[0].capture_begin(pool=mempool)
            self.logits.copy_(self.model.forward(self.static.inputs(t, lora), self.kv))
            graph[0].capture_end()
            pieces.append(graph[0])
        torch.cuda.current_stream().wait_stream(self._stream)
        self._calls = calls
        return pieces

    def run(self, scheduled):
        """(logits [n, vocab] fp32, the n sequences sampled) of this step, or None when it does not
        fit (more tokens than the largest bucket, more sampled rows than max_rows)."""
        order, prefill, decode, (tokens, positions, slots, sample, sampled) = step_rows(scheduled, self.block_size)
        t = pick(len(tokens), self.buckets)
        if t is None or len(sample) > self.max_rows or len(scheduled) > self.max_rows:
            return None
        has = {m: h.numpy() for m, h in self.pool.has_module.items()} if self.pool is not None else {}
        lora = self.static.fill(t, (order, tokens, positions, slots, sample), has)
        c = self.model.cfg
        batch = attention_rows(prefill, decode, len(tokens) - len(decode), self.block_size, self.device, c.num_kv_heads)
        q, o = self.q[:t], self.o[:t]
        with torch.inference_mode():
            for i, graph in enumerate(self._pieces[(t, lora)]):
                graph.replay()
                if i < len(self._calls):
                    k_cache, v_cache, scale, window, softcap = self._calls[i]
                    paged_attention(o, q, k_cache, v_cache, batch, scale, window, softcap)
        return self.logits[: len(sampled)], sampled
