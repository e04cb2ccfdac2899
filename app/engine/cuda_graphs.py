"""Decode steps as CUDA graphs: one per batch-size bucket (with and without the LoRA add-on),
captured at start-up on static input buffers and replayed with this step's inputs copied in.

What a graph holds may not depend on the step it was captured with, so its inputs have the
bucket's shape whatever the batch: rows past the batch are padding (KV slot −1: nothing
written; context length 0: zero attention output); the LoRA segments are always `bucket`
segments over `bucket` rows (this step's runs of one adapter, then one run of padding rows
with slot −1, then empty ones), so the SGMV kernel and grid, picked from host-known shapes
only, are the same for every adapter mix; every module the pool can hold is in the graph
(a run whose adapter lacks the module has slot −1 there). The paged decode kernel's grid
depends on the batch shape only. All of a bucket's inputs are one int32 buffer, filled on
the host and copied in one transfer per step; the host copy is refilled only once that
transfer is done (a step launched ahead refills it while the GPU still runs the one before).
A step launched ahead also gets its input tokens on the device, from the previous step's drawn tokens.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from app.engine.staging_buffer import StagingBuffer
from app.model.inputs import LoraSegments, StepInputs
from ops.paged_attention import DecodeRows, PagedBatch, decode_splits

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 8, up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(b, max_batch) for b in sizes})


class _Bucket:
    """One bucket's static inputs, in one staging buffer (app/engine/staging_buffer.py)."""

    def __init__(self, size: int, max_blocks: int, modules: list[str], device):
        self.size, self.modules = size, modules
        parts = {
            "tokens": size,
            "positions": size,
            "slots": size,
            "lens": size,
            "tables": (size, max_blocks),
            "indptr": size + 1,
            "slot_ids": (len(modules), size),
            "src_rows": size,
        }
        self.staging = StagingBuffer(parts, device)
        self.dev, self.host = self.staging.dev, self.staging.host
        self.sample_rows = torch.arange(size, device=device)

    def inputs(self, lora: bool, kv_heads: int) -> StepInputs:
        d = self.dev
        segs = LoraSegments(d["indptr"], {m: d["slot_ids"][j] for j, m in enumerate(self.modules)}, None)
        return StepInputs(
            d["tokens"],
            d["positions"],
            d["slots"],
            PagedBatch(
                None, DecodeRows(0, d["tables"], d["lens"], decode_splits(self.size, kv_heads, d["tokens"].device))
            ),
            self.sample_rows,
            segs if lora else None,
        )

    def fill_idle(self) -> None:
        """Inputs that touch nothing: no KV written, no context, no LoRA rows."""
        h = self.host
        h["tokens"][:], h["positions"][:], h["slots"][:], h["lens"][:] = 0, 0, -1, 0
        h["indptr"][:], h["slot_ids"][:] = 0, -1
        self.staging.send_now()

    def fill(self, order, pool, block_size: int, next_tokens=None) -> bool:
        """This step's decode rows (sorted by adapter); returns whether any row uses an adapter.
        next_tokens: (token ids [m] int64 on the device, each row's index into them), the input
        tokens when the host does not know them yet."""
        self.staging.wait_sent()
        h, n = self.host, len(order)
        if next_tokens is not None:
            h["src_rows"][:n], h["src_rows"][n:] = next_tokens[1], 0
        for i, seq in enumerate(order):
            pos = seq.num_computed
            if next_tokens is None:
                h["tokens"][i] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
            h["positions"][i] = pos
            h["slots"][i] = seq.block_table[pos // block_size] * block_size + pos % block_size
            h["lens"][i] = pos + 1
            h["tables"][i, : len(seq.block_table)] = seq.block_table
        h["slots"][n:], h["lens"][n:] = -1, 0
        runs: list[list[int]] = []  # [slot, rows]
        for seq in order:
            if runs and runs[-1][0] == seq.lora_slot:
                runs[-1][1] += 1
            else:
                runs.append([seq.lora_slot, 1])
        if n < self.size:
            runs.append([-1, self.size - n])
        bounds = np.cumsum([0] + [r for _, r in runs])
        h["indptr"][: len(bounds)] = bounds
        h["indptr"][len(bounds) :] = self.size
        slots = np.array([s for s, _ in runs])
        for j, m in enumerate(self.modules):
            has = pool.has_module[m].numpy()[np.maximum(slots, 0)]
            h["slot_ids"][j, : len(runs)] = np.where((slots >= 0) & has, slots, -1)
            h["slot_ids"][j, len(runs) :] = -1
        self.staging.send()
        if next_tokens is not None:
            self.dev["tokens"][:n].copy_(next_tokens[0].index_select(0, self.dev["src_rows"][:n]))
        return bool((slots >= 0).any())


class DecodeGraphs:
    """Captured decode forwards for every bucket up to max_batch; `run` replays one."""

    def __init__(self, model, kv, max_batch: int, max_blocks: int, block_size: int, device):
        self.model, self.kv, self.block_size = model, kv, block_size
        pool = model.lora_pool
        modules = list(pool.has_module) if pool is not None else []
        self.buckets = buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self._buckets = {b: _Bucket(b, max_blocks, modules, device) for b in self.buckets}
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        mempool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            for lora in (False, True) if pool is not None else (False,):
                self._graphs[(b, lora)] = self._capture(self._buckets[b], lora, mempool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured %d decode CUDA graphs (batch buckets %s) in %.2f s",
            len(self._graphs),
            self.buckets,
            self.capture_seconds,
        )

    def _capture(self, bucket: _Bucket, lora: bool, mempool):
        inputs = bucket.inputs(lora, self.model.cfg.num_kv_heads)
        bucket.fill_idle()
        self.model.forward(inputs, self.kv)  # warm-up: kernels loaded, cuBLAS workspaces made
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            logits = self.model.forward(inputs, self.kv)
        return graph, logits

    def run(self, order, next_tokens=None) -> torch.Tensor:
        """Logits [len(order), vocab] of one decode step; order: the sequences, sorted by adapter
        slot; next_tokens: see _Bucket.fill (None: each row's last token, known on the host)."""
        size = next(b for b in self.buckets if b >= len(order))
        bucket = self._buckets[size]
        lora = bucket.fill(order, self.model.lora_pool, self.block_size, next_tokens)
        graph, logits = self._graphs[(size, lora)]
        graph.replay()
        return logits[: len(order)]
