"""Fixed adapter slots per layer and module, allocated once; LRU with reference counts.

Layout per module m (see ops/reference.py): A[m]: [layers, slots, max_rank, in],
B[m]: [layers, slots, max_rank, out]; ranks/scales: [slots]. An adapter used by a
running request is pinned (refcount > 0) and never evicted; when every slot is
pinned, ``acquire`` returns None and the request waits.

On CUDA a load is asynchronous: one host→device copy of the adapter's packed
(pinned) buffer on a side stream, then device-side scatter into the slot; the
engine keeps stepping other requests and admits the adapter's requests once
``ready(slot)`` (the copy's event has completed).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import time
from typing import Callable

import torch

from adapters_store.peft_weights import LoraWeights, ModelShape

AdapterKey = tuple[str, str]  # (name, version)


@dataclass(frozen=True)
class PoolConfig:
    num_slots: int = 8
    max_rank: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


class LoraPool:
    def __init__(self, shape: ModelShape, config: PoolConfig,
                 on_load: Callable[[int, float], None] = lambda nbytes, seconds: None):
        """on_load(bytes, seconds): called when a load into a slot completes (for metrics)."""
        self.config = config
        self.on_load = on_load
        L, S, R = shape.num_layers, config.num_slots, config.max_rank
        alloc = dict(dtype=config.dtype, device=config.device)
        self.A = {m: torch.zeros(L, S, R, d_in, **alloc) for m, (d_in, _) in shape.dims.items()}
        self.B = {m: torch.zeros(L, S, R, d_out, **alloc) for m, (_, d_out) in shape.dims.items()}
        self.ranks = torch.zeros(S, dtype=torch.int32, device=config.device)
        self.scales = torch.zeros(S, dtype=torch.float32, device=config.device)
        self.slot_rank, self.slot_scale = [0] * S, [0.0] * S  # host mirrors: batches are planned on the host
        # has_module[m][slot]: the adapter in the slot targets module m (else its segments skip m)
        self.has_module = {m: torch.zeros(S, dtype=torch.bool) for m in shape.dims}
        self._slot_of: OrderedDict[AdapterKey, int] = OrderedDict()  # LRU order, oldest first
        self._refs: dict[AdapterKey, int] = {}
        self._free = list(range(S - 1, -1, -1))
        self.loads = 0
        self.evictions = 0
        cuda = torch.device(config.device).type == "cuda"
        self._copy_stream = torch.cuda.Stream(config.device) if cuda else None
        self._pending: dict[int, tuple] = {}  # slot -> (done event, start time, bytes, staging buffer)

    def acquire(self, weights: LoraWeights) -> int | None:
        """Pin the adapter in a slot (loading it if needed); None if every slot is pinned."""
        key = (weights.name, weights.version)
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self._load(slot, weights)
            self._slot_of[key] = slot
        self._slot_of.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return slot

    def release(self, key: AdapterKey) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]

    def pinned(self) -> int:
        return len(self._refs)

    def resident(self) -> list[AdapterKey]:
        return list(self._slot_of)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._slot_of if k not in self._refs), None)
        if victim is None:
            return None
        self.evictions += 1
        return self._slot_of.pop(victim)

    def ready(self, slot: int) -> bool:
        """The slot's weights are on the device (always true on the CPU)."""
        pending = self._pending.get(slot)
        if pending is None:
            return True
        if not pending[0].query():
            return False
        del self._pending[slot]
        self.on_load(pending[2], time.perf_counter() - pending[1])
        return True

    def _load(self, slot: int, weights: LoraWeights) -> None:
        r, scale = weights.manifest.rank, weights.manifest.scale
        self.slot_rank[slot], self.slot_scale[slot] = r, scale
        for m in self.A:
            self.has_module[m][slot] = False
        for _, m in weights.tensors:
            self.has_module[m][slot] = True
        self.loads += 1
        if self._copy_stream is None:
            start = time.perf_counter()
            self._fill(slot, weights.tensors, r, scale)
            self.on_load(weights.nbytes, time.perf_counter() - start)
            return
        start = time.perf_counter()
        # the slot may still be read by a step already queued on the compute stream
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.config.device))
        with torch.cuda.stream(self._copy_stream):
            staging, tensors = _to_device(weights, self.config.device)
            self._fill(slot, tensors, r, scale)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._pending[slot] = (done, start, weights.nbytes, staging)

    def _fill(self, slot: int, tensors: dict, r: int, scale: float) -> None:
        by_module: dict[str, dict[int, tuple]] = {}
        for (layer, m), pair in tensors.items():
            by_module.setdefault(m, {})[layer] = pair
        for m in self.A:
            self.A[m][:, slot].zero_()
            self.B[m][:, slot].zero_()
        for m, layers in by_module.items():
            stacked = _stacked(layers, self.A[m].shape[0])
            if stacked is not None:  # one strided copy per matrix for all layers
                self.A[m][:, slot, :r].copy_(stacked[0])  # [L, r, in]
                self.B[m][:, slot, :r].copy_(stacked[1].transpose(1, 2))  # [L, out, r] -> [L, r, out]
                continue
            for layer, (a, b) in layers.items():
                self.A[m][layer, slot, :r].copy_(a)  # a: [r, in]
                self.B[m][layer, slot, :r].copy_(b.T)  # b: [out, r] -> [r, out]
        self.ranks[slot].fill_(r)
        self.scales[slot].fill_(scale)


def _stacked(layers: dict[int, tuple], num_layers: int):
    """Every layer's A (and B) as one [L, ...] view when they lie evenly spaced in one buffer."""
    if len(layers) != num_layers:
        return None
    views = []
    for k in (0, 1):
        ts = [layers[i][k] for i in range(num_layers)]
        base = ts[0]
        step = ts[1].storage_offset() - base.storage_offset() if num_layers > 1 else 0
        if not all(t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                   and t.storage_offset() == base.storage_offset() + i * step and t.is_contiguous()
                   for i, t in enumerate(ts)):
            return None
        views.append(base.as_strided((num_layers, *base.shape), (step, *base.stride()), base.storage_offset()))
    return views


def _to_device(weights: LoraWeights, device) -> tuple[torch.Tensor | None, dict]:
    """The adapter's tensors on the device, through one copy when the host cache packed
    them into a single pinned buffer (else one copy per tensor)."""
    first = next(iter(weights.tensors.values()))[0]
    storage = first.untyped_storage()
    packed = first.is_pinned() and all(
        t.untyped_storage().data_ptr() == storage.data_ptr() for pair in weights.tensors.values() for t in pair)
    if not packed:
        return None, {k: (a.to(device, non_blocking=True), b.to(device, non_blocking=True))
                      for k, (a, b) in weights.tensors.items()}
    flat = torch.empty(0, dtype=first.dtype).set_(storage)
    staging = flat.to(device, non_blocking=True)
    view = lambda t: staging.as_strided(t.shape, t.stride(), t.storage_offset())  # noqa: E731
    return staging, {k: (view(a), view(b)) for k, (a, b) in weights.tensors.items()}
