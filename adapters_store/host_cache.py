"""Parsed adapters in host memory, LRU by bytes under a budget, keyed by (name, version).

Where CUDA is present the tensors of each adapter are packed into one pinned
buffer (views into it), so the GPU pool's host→device copies are truly
asynchronous and one allocation serves a whole adapter. Eviction only drops the
cache's reference: an adapter still held by a loader stays valid until released.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from adapters_store.peft_weights import LoraWeights

log = logging.getLogger("loraplex.adapters")
AdapterKey = tuple[str, str]  # (name, version)


@dataclass(frozen=True)
class HostCacheConfig:
    budget_bytes: int = 8 << 30
    pin_memory: bool | None = None  # None: pin when CUDA is available
    # the serving dtype: staged once here, so host memory and every host→GPU copy carry
    # half the bytes of fp32 (rounding here or on the GPU gives the same values)
    dtype: torch.dtype = torch.float32


def pack(weights: LoraWeights, pin: bool, dtype: torch.dtype = torch.float32) -> LoraWeights:
    """The same adapter with every tensor a view into one contiguous (pinned) ``dtype`` buffer."""
    # module-major, layer-minor: each module's layers sit evenly spaced in the buffer, so the
    # GPU pool moves a whole module with one strided copy (see gpu_pool._stacked)
    items = sorted(weights.tensors.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    total = sum(a.numel() + b.numel() for _, (a, b) in items)
    flat = torch.empty(total, dtype=dtype, pin_memory=pin)
    offset, tensors = 0, {}

    def take(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        view = flat[offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        offset += t.numel()
        return view

    for where, (a, b) in items:
        tensors[where] = (take(a), take(b))
    return replace(weights, tensors=tensors)


class HostCache:
    def __init__(self, config: HostCacheConfig, on_evict: Callable[[AdapterKey], None] = lambda key: None):
        self.config = config
        self.pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[AdapterKey, LoraWeights] = OrderedDict()  # LRU, oldest first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[AdapterKey]:
        with self._lock:
            return list(self._entries)

    def get(self, key: AdapterKey) -> LoraWeights | None:
        with self._lock:
            weights = self._entries.get(key)
            if weights is not None:
                self._entries.move_to_end(key)
            return weights

    def put(self, weights: LoraWeights) -> LoraWeights:
        """Cache weights (packed/pinned if configured) and return what callers should use."""
        key = (weights.name, weights.version)
        if self.pin or self.config.dtype != torch.float32:
            weights = pack(weights, pin=self.pin, dtype=self.config.dtype)
        if weights.nbytes > self.config.budget_bytes:
            log.warning("adapter %s (%d bytes) exceeds the host cache budget: served uncached", key, weights.nbytes)
            return weights
        evicted = []
        with self._lock:
            if key in self._entries:  # a racing load of the same version: keep the first
                return self._entries[key]
            self._entries[key] = weights
            self.nbytes += weights.nbytes
            while self.nbytes > self.config.budget_bytes:
                old_key, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
                evicted.append(old_key)
        for old_key in evicted:
            self._on_evict(old_key)
        return weights

    def drop_name(self, name: str) -> None:
        """Forget every version of an adapter (it was unregistered)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == name]:
                self.nbytes -= self._entries.pop(key).nbytes
