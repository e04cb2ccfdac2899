"""Fixed adapter slots per layer and module, allocated once; LRU with reference counts.

Layout per module m (see ops/reference.py): A[m]: [layers, slots, max_rank, in],
B[m]: [layers, slots, max_rank, out]; ranks/scales: [slots]. An adapter used by a
running request is pinned (refcount > 0) and never evicted; when every slot is
pinned, ``acquire`` returns None and the request waits.

On CUDA a load is asynchronous, issued from the pool's copier thread: the adapter's
packed host buffer is copied into one of two pinned staging buffers (allocated once,
here: pinning memory later would stall every CUDA call of the process, see
adapters_store/host_cache.py), then one host→device copy on a side stream and one
device-side copy per matrix and module into the slot (adapters_store.host_cache.pack
lays the buffer out for that); the engine keeps stepping other requests and admits the
adapter's requests once ``ready(slot)`` (the copy's event has completed).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from adapters_store.host_cache import pack
from adapters_store.peft_weights import LoraWeights, ModelShape, ModuleStack

AdapterKey = tuple[str, str]  # (name, version)


@dataclass(frozen=True)
class PoolConfig:
    num_slots: int = 8
    max_rank: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def adapter_bytes(shape: ModelShape, rank: int, dtype: torch.dtype) -> int:
    """The largest adapter of this rank: A and B of every module and layer (one pool slot)."""
    return shape.num_layers * rank * sum(d_in + d_out for d_in, d_out in shape.dims.values()) * dtype.itemsize


def slots_for_budget(shape: ModelShape, max_rank: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many slots of max_rank fit in budget_bytes."""
    per_slot = adapter_bytes(shape, max_rank, dtype)
    if budget_bytes < per_slot:
        raise ValueError(f"{budget_bytes} bytes hold no adapter slot: one of rank {max_rank} takes {per_slot}")
    return budget_bytes // per_slot


class LoraPool:
    def __init__(
        self,
        shape: ModelShape,
        config: PoolConfig,
        on_load: Callable[[int, float], None] = lambda nbytes, seconds: None,
    ):
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
        self.slot_bytes = adapter_bytes(shape, config.max_rank, config.dtype)
        self.hits = 0  # acquires that found the adapter in a slot
        self.misses = 0  # times a non-resident adapter was asked for (one per episode, until it gets a slot)
        self._refused: set[AdapterKey] = set()  # asked for while every slot was pinned: still to be loaded
        self.loads = 0
        self.evictions = 0
        cuda = torch.device(config.device).type == "cuda"
        self._copy_stream = torch.cuda.Stream(config.device) if cuda else None
        # loads are issued from their own thread: issuing one (a few dozen launches) would
        # otherwise lengthen the engine step that admits its request
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="lora-h2d") if cuda else None
        # the copier's pinned staging buffers, each free again once its last copy's event has completed
        self._staging = (
            [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if cuda else []
        )
        self._staged: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._turn = 0  # the staging buffer the copier thread filled last
        self._pending: dict[int, tuple[Future, float, int]] = {}  # slot -> (copy, start time, bytes)
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def acquire(self, weights: LoraWeights) -> int | None:
        """Pin the adapter in a slot (loading it if needed); None if every slot is pinned."""
        key = (weights.name, weights.version)
        slot = self._slot_of.get(key)
        if slot is not None:
            self.hits += 1
        else:
            if key not in self._refused:  # a request retried each step, or several asking, is one miss
                self.misses += 1
            slot = self._take_slot()
            if slot is None:
                self._refused.add(key)
                return None
            self._refused.discard(key)
            try:
                self._load(slot, weights)
            except Exception:  # the slot stays free for the next adapter; the caller fails this one
                self._free.append(slot)
                raise
            self._slot_of[key] = slot
        self._slot_of.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return slot

    def release(self, key: AdapterKey) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            slot = self._slot_of[key]
            copy = self._pending.get(slot, (None,))[0]
            if copy is not None and copy.done() and copy.exception() is not None:  # a failed copy: unmap it
                del self._pending[slot], self._slot_of[key]
                self._free.append(slot)

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
        copy, start, nbytes = pending
        if not (copy.done() and copy.result()[0].query()):  # result() re-raises a failed copy
            return False
        del self._pending[slot]
        self.on_load(nbytes, time.perf_counter() - start)
        return True

    def _load(self, slot: int, weights: LoraWeights) -> None:
        if weights.stacks is None or weights.buffer.dtype != self.config.dtype:  # lay it out as the pool wants
            weights = pack(weights, dtype=self.config.dtype)
        r, scale = weights.manifest.rank, weights.manifest.scale
        self.slot_rank[slot], self.slot_scale[slot] = r, scale
        for m, has in self.has_module.items():
            has[slot] = m in weights.stacks
        self.loads += 1
        start = time.perf_counter()
        if self._copier is None:
            self.fill(slot, weights.stacks, r, scale)
            self.on_load(weights.nbytes, time.perf_counter() - start)
            return
        slot_free = torch.cuda.Event()  # the slot may still be read by steps queued before now
        slot_free.record(torch.cuda.current_stream(self.config.device))
        self._pending[slot] = (self._copier.submit(self._copy, slot, weights, slot_free), start, weights.nbytes)

    def _copy(self, slot: int, weights: LoraWeights, slot_free: torch.cuda.Event):
        """On the copier thread: (done event, the device buffer to keep alive until done)."""
        pinned, k = self._stage(weights.buffer)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(slot_free)
            staging = pinned.to(self.config.device, non_blocking=True)  # the one host→device copy
            on_device = lambda t: staging.as_strided(t.shape, t.stride(), t.storage_offset())  # noqa: E731
            self.fill(
                slot,
                {m: ModuleStack(st.layers, on_device(st.A), on_device(st.Bt)) for m, st in weights.stacks.items()},
                weights.manifest.rank,
                weights.manifest.scale,
            )
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._staged[k] = done
        return done, staging

    def _stage(self, buf: torch.Tensor) -> tuple[torch.Tensor, int]:
        """buf (a whole host buffer, ≤ slot_bytes) copied into the next free pinned staging buffer;
        buf itself is free again on return. torch's copy runs on its CPU thread pool: one thread
        (numpy) copied 80 MB in 15 ms, and a burst of cold adapters queues on this one copier."""
        k = self._turn = 1 - self._turn
        if self._staged[k] is not None:
            self._staged[k].synchronize()  # its previous host→device copy has read it
        pinned = self._staging[k][: buf.nbytes]
        pinned.copy_(buf.view(torch.uint8))
        return pinned.view(buf.dtype), k

    def _index(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The layer numbers on the device, made once per layout (a few per deployment)."""
        index = self._indices.get(layers)
        if index is None:
            index = self._indices[layers] = torch.tensor(layers, dtype=torch.long, device=self.config.device)
        return index

    def fill(self, slot: int, stacks: dict[str, ModuleStack], r: int, scale: float) -> None:
        """Rows beyond the rank and modules the adapter lacks are left as they are: the
        kernels read A/B only up to the slot's rank, and segments skip untargeted modules."""
        for m, st in stacks.items():
            a, b = self.A[m][:, slot, :r], self.B[m][:, slot, :r]  # [L, r, in], [L, r, out]
            if st.layers == tuple(range(a.shape[0])):
                a.copy_(st.A)
                b.copy_(st.Bt)  # a transposing copy when Bt is B's own layout read by strides
            else:  # some layers, or in the file's order (a fast-loaded PEFT file: 0, 1, 10, 11, ...)
                index = self._index(st.layers)
                a.index_copy_(0, index, st.A.to(a.dtype))
                b.index_copy_(0, index, st.Bt.to(b.dtype))
        self.ranks[slot].fill_(r)
        self.scales[slot].fill_(scale)
