"""Parsed adapters in host memory, LRU by bytes under a budget, keyed by (name, version).

Where CUDA is present (or a serving dtype other than fp32 is set) the tensors of
each adapter are packed into one buffer in the serving dtype, laid out as the GPU
pool's slots want it (see ``pack``), so the pool's host→device copy is one transfer.
Eviction only drops the cache's reference: an adapter still held by a loader stays
valid until released. The budget counts the buffers' bytes.

Buffers are never page-locked here: pinning memory (cudaHostAlloc) holds up every CUDA call of the
process while it runs — on the H200 a thread pinning 128 MiB blocks (73 ms each) cut a GPU loop
beside it from 117 to 3.7 iterations a second (benchmarks/adapter_cold_load.py, ``pinning``), so a
cold load that pinned its buffer stalled the engine. The GPU pool
stages its copies through two pinned buffers it allocates once (adapters_store/gpu_pool.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from adapters_store.peft_weights import LoraWeights, ModuleStack

log = logging.getLogger("loraplex.adapters")
AdapterKey = tuple[str, str]  # (name, version)


@dataclass(frozen=True)
class HostCacheConfig:
    budget_bytes: int = 8 << 30
    # the serving dtype: staged once here, so host memory and every host→GPU copy carry
    # half the bytes of fp32 (rounding here or on the GPU gives the same values)
    dtype: torch.dtype = torch.float32


def pack(weights: LoraWeights, dtype: torch.dtype = torch.float32) -> LoraWeights:
    """The same adapter in one contiguous ``dtype`` buffer: per module, every
    layer's A, then every layer's B transposed ([rank, out], the GPU pool's layout).
    Each matrix is copied (and converted) straight into its place: no temporary."""
    by_module: dict[str, list[int]] = {}
    for layer, m in sorted(weights.tensors):
        by_module.setdefault(m, []).append(layer)
    total = sum(a.numel() + b.numel() for a, b in weights.tensors.values())
    flat = torch.empty(total, dtype=dtype)
    offset, stacks, tensors = 0, {}, {}

    def block(matrices: list[torch.Tensor]) -> torch.Tensor:
        nonlocal offset
        view = flat[offset : offset + sum(t.numel() for t in matrices)].view(len(matrices), *matrices[0].shape)
        # straight into place (converting if need be): for B^T ~2.5x faster here than a copy_ per
        # layer (torch's 2-D transposing copy of fp16 is slow) and no temporary like stack-then-copy
        torch.stack(matrices, out=view)
        offset += view.numel()
        return view

    for m, layers in by_module.items():
        a = block([weights.tensors[layer, m][0] for layer in layers])  # [L_m, r, in]
        bt = block([weights.tensors[layer, m][1].T for layer in layers])  # [L_m, r, out]
        stacks[m] = ModuleStack(tuple(layers), a, bt)
        tensors.update({(layer, m): (a[i], bt[i].T) for i, layer in enumerate(layers)})
    return replace(weights, tensors=tensors, buffer=flat, stacks=stacks)


def _holders(buf: torch.Tensor) -> int:
    """Tensors sharing buf's storage, buf included (every view holds a reference to it); a torch
    without the count says "held" (no reuse, never a buffer refilled under a reader)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(buf.untyped_storage()._cdata) - 1 if count else 1 << 30  # less untyped_storage()'s own


class Spares:
    """Buffers of adapters the cache let go, handed to the next cold load of the same size once
    nothing else holds them: no request still using the adapter, no copy into the GPU pool's
    staging buffer in flight (the pool's copier holds the adapter until then). Reuse spares each
    cold load a fresh 80 MB allocation, whose pages all fault again.
    At most ``keep`` are kept (oldest dropped): memory beyond the budget by that much at most."""

    def __init__(self, keep: int):
        self.keep, self.reused = keep, 0
        self._lock = threading.Lock()
        self._bufs: list[torch.Tensor] = []

    def give(self, buf: torch.Tensor | None) -> None:
        if buf is None or buf.storage_offset() or buf.untyped_storage().nbytes() != buf.nbytes:
            return  # not a whole buffer of its own (a view into something else): never reused
        with self._lock:
            self._bufs.append(buf)
            del self._bufs[: -self.keep or len(self._bufs)]

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            for i, buf in enumerate(self._bufs):
                if buf.numel() == numel and buf.dtype == dtype and _holders(buf) == 1:
                    self.reused += 1
                    return self._bufs.pop(i)
        return None


class HostCache:
    def __init__(
        self, config: HostCacheConfig, on_evict: Callable[[AdapterKey], None] = lambda key: None, spares: int = 8
    ):
        """spares: evicted buffers kept for reuse (about the loads in flight: see Spares)."""
        self.config = config
        self.spares = Spares(spares)
        self.contiguous = torch.cuda.is_available()  # the pool's one host→device copy wants one buffer
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[AdapterKey, LoraWeights] = OrderedDict()  # LRU, oldest first
        self.nbytes = 0  # host bytes held by the entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[AdapterKey]:
        with self._lock:
            return list(self._entries)

    def alloc(self, numel: int) -> torch.Tensor:
        """A host buffer for one adapter in the serving dtype: a spare (an evicted adapter's buffer
        that nothing holds) if one has the size, else a new one."""
        spare = self.spares.take(numel, self.config.dtype)
        return spare if spare is not None else torch.empty(numel, dtype=self.config.dtype)

    def get(self, key: AdapterKey) -> LoraWeights | None:
        with self._lock:
            weights = self._entries.get(key)
            if weights is not None:
                self._entries.move_to_end(key)
            return weights

    def put(self, weights: LoraWeights) -> LoraWeights:
        """Cache weights (packed in the serving dtype where needed) and return what callers should use."""
        key = (weights.name, weights.version)
        packed = weights.buffer is not None and weights.buffer.dtype == self.config.dtype
        # parsed tensors keep the file's dtype (fp16 of an fp16 file): the cache holds the serving dtype
        foreign = lambda: any(t.dtype != self.config.dtype for pair in weights.tensors.values() for t in pair)  # noqa: E731
        if not packed and (self.contiguous or self.config.dtype != torch.float32 or foreign()):
            weights = pack(weights, dtype=self.config.dtype)
        cost = weights.nbytes
        if cost > self.config.budget_bytes:
            log.warning("adapter %s (%d bytes) exceeds the host cache budget: served uncached", key, cost)
            return weights
        evicted = []
        with self._lock:
            if key in self._entries:  # a racing load of the same version: keep the first
                kept = self._entries[key]
            else:
                kept = self._entries[key] = weights
                self.nbytes += cost
                while self.nbytes > self.config.budget_bytes:
                    old_key, old = self._entries.popitem(last=False)
                    self.nbytes -= old.nbytes
                    evicted.append((old_key, old.buffer))
        if kept is not weights:
            self.spares.give(weights.buffer)
        for old_key, buf in evicted:
            self.spares.give(buf)
            self._on_evict(old_key)
        return kept

    def drop_name(self, name: str) -> None:
        """Forget every version of an adapter (it was unregistered)."""
        with self._lock:
            dropped = [self._entries.pop(key) for key in [k for k in self._entries if k[0] == name]]
            self.nbytes -= sum(w.nbytes for w in dropped)
        for weights in dropped:
            self.spares.give(weights.buffer)
