"""The GPU adapter pool: slots sized from a memory budget, LRU with reference counts (a
running request's adapter is never evicted; all slots pinned → the request waits), slot
contents equal the adapter's weights (also for adapters on a subset of layers and in a
narrower dtype), and on CUDA the asynchronous load never overwrites a slot that steps
already queued may still read, nor a staging buffer a copy still reads."""

import dataclasses

import pytest
import torch

from adapters_store.gpu_pool import LoraPool, PoolConfig, slots_for_budget
from adapters_store.host_cache import pack
from adapters_store.manifest import AdapterManifest
from adapters_store.peft_weights import LoraWeights
from tests.support.store_helpers import TINY_SHAPE as SHAPE


def adapter(name: str, rank: int, modules=("q_proj", "down_proj"), layers=None, seed=0) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    layers = range(SHAPE.num_layers) if layers is None else layers
    tensors = {
        (layer, m): (
            torch.randn(rank, SHAPE.dims[m][0], generator=gen),
            torch.randn(SHAPE.dims[m][1], rank, generator=gen),
        )
        for layer in layers
        for m in modules
    }
    return LoraWeights(name, "v1", AdapterManifest(rank, 0.5 + seed, False, list(modules)), tensors)


def assert_in_slot(pool: LoraPool, slot: int, w: LoraWeights) -> None:
    r = w.manifest.rank
    assert pool.slot_rank[slot] == r and int(pool.ranks[slot]) == r and float(pool.scales[slot]) == w.manifest.scale
    for (layer, m), (a, b) in w.tensors.items():
        assert torch.equal(pool.A[m][layer, slot, :r].cpu(), a.to(pool.config.dtype)), (layer, m)
        assert torch.equal(pool.B[m][layer, slot, :r].cpu(), b.T.to(pool.config.dtype)), (layer, m)
    for m, has in pool.has_module.items():
        assert bool(has[slot]) == any(mm == m for _, mm in w.tensors), m


def test_slots_are_sized_from_a_memory_budget():
    per_slot = 3 * 8 * sum(i + o for i, o in SHAPE.dims.values()) * 2  # layers * rank * (in + out) * fp16
    assert slots_for_budget(SHAPE, 8, torch.float16, 10 * per_slot + 1) == 10
    with pytest.raises(ValueError, match="no adapter slot"):
        slots_for_budget(SHAPE, 8, torch.float16, per_slot - 1)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_slots_hold_the_adapters_weights(dtype):
    pool = LoraPool(SHAPE, PoolConfig(num_slots=3, max_rank=16, dtype=dtype))
    ws = [
        adapter("full", 16, seed=1),
        adapter("partial", 4, ("v_proj", "gate_proj"), layers=[0, 2], seed=2),
        pack(adapter("packed", 8, seed=3), dtype=torch.bfloat16),
    ]
    slots = [pool.acquire(w) for w in ws]
    assert sorted(slots) == [0, 1, 2]
    for w, slot in zip(ws, slots):
        assert_in_slot(pool, slot, w)


def test_lru_with_reference_counts_never_evicts_a_running_adapter():
    pool = LoraPool(SHAPE, PoolConfig(num_slots=2, max_rank=8))
    a, b, c = (adapter(n, 4, seed=i) for i, n in enumerate("abc"))
    sa, sb = pool.acquire(a), pool.acquire(b)
    assert pool.acquire(c) is None  # both pinned by running requests: c waits, nothing evicted
    assert pool.resident() == [("a", "v1"), ("b", "v1")] and pool.evictions == 0
    pool.release(("b", "v1"))
    assert pool.acquire(c) == sb and pool.evictions == 1  # b was the only unpinned one
    assert_in_slot(pool, sa, a)
    assert_in_slot(pool, sb, c)
    pool.release(("a", "v1"))
    assert pool.acquire(a) == sa and pool.loads == 3  # still resident: a hit, no load
    pool.release(("a", "v1"))
    pool.release(("c", "v1"))
    pool.acquire(c)  # c is now the most recently used: a goes first
    assert pool.acquire(dataclasses.replace(b, version="v2")) == sa and pool.resident()[0] == ("c", "v1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_load_waits_for_queued_steps_then_fills_the_slot():
    pool = LoraPool(SHAPE, PoolConfig(num_slots=2, max_rank=16, dtype=torch.float16, device="cuda"))
    w = pack(adapter("a", 16, seed=5), dtype=torch.float16)
    before = [t.clone() for t in (*pool.A.values(), *pool.B.values())]
    torch.cuda._sleep(500_000_000)  # a long step already queued on the compute stream (~0.3 s)...
    seen = [t.clone() for t in (*pool.A.values(), *pool.B.values())]  # ...that reads every slot after it
    slot = pool.acquire(w)
    torch.cuda.synchronize()
    while not pool.ready(slot):
        pass
    # the queued step read the slots as they were before: the copy waited for it (one that did
    # not would land during the sleep). No clock: a host stalled past the sleep only delays the copy
    assert all(torch.equal(a, b) for a, b in zip(seen, before))
    assert_in_slot(pool, slot, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_in_a_row_go_through_the_two_staging_buffers_exactly():
    """Five adapters acquired back to back while the device is busy (their host buffers pageable,
    as the host tier keeps them), so the copier must wrap around its two staging buffers while
    the first copies still wait: every slot holds its own adapter, so no staging buffer was
    refilled while a copy still had to read it."""
    pool = LoraPool(SHAPE, PoolConfig(num_slots=5, max_rank=16, dtype=torch.float16, device="cuda"))
    # ranks of powers of two: each scale (0.5 + seed) / rank is exact in the slots' fp32
    ws = [pack(adapter(f"a{k}", r, seed=10 + k), dtype=torch.float16) for k, r in enumerate((16, 8, 4, 2, 16))]
    assert not any(w.buffer.is_pinned() for w in ws)
    torch.cuda._sleep(200_000_000)  # copies queue behind a busy device, as beside a running step
    slots = [pool.acquire(w) for w in ws]
    while not all(pool.ready(s) for s in slots):
        pass
    for w, slot in zip(ws, slots):
        assert_in_slot(pool, slot, w)
