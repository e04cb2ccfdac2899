"""Fixed adapter slots per layer and module, allocated once; LRU with reference counts.

Layout per module m (see ops/reference.py): A[m]: [layers, slots, max_rank, in],
B[m]: [layers, slots, max_rank, out]; ranks/scales: [slots]. An adapter used by a
running request is pinned (refcount > 0) and never evicted; when every slot is
pinned, ``acquire`` returns None and the request waits.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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
    def __init__(self, shape: ModelShape, config: PoolConfig):
        self.config = config
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

    def _load(self, slot: int, weights: LoraWeights) -> None:
        r = weights.manifest.rank
        for m in self.A:
            self.A[m][:, slot].zero_()
            self.B[m][:, slot].zero_()
            self.has_module[m][slot] = False
        for (layer, m), (a, b) in weights.tensors.items():
            self.A[m][layer, slot, :r].copy_(a)  # a: [r, in]
            self.B[m][layer, slot, :r].copy_(b.T)  # b: [out, r] -> [r, out]
            self.has_module[m][slot] = True
        self.ranks[slot] = r
        self.scales[slot] = weights.manifest.scale
        self.slot_rank[slot], self.slot_scale[slot] = r, weights.manifest.scale
        self.loads += 1
