"""Paged KV cache: fixed-size blocks, blocks outermost, per-request block tables.

A request owns a list of block ids; joining or leaving allocates or frees ids,
never copies KV. The choices of one request (n > 1) share their prompt's full blocks by
reference count (``share``; app/engine/scheduler.py forks them). A full block may also
hold a cached prefix (app/engine/prefix_cache.py):
it is then shared read-only by reference count, and once no request holds it, it stays
cached until a block is needed and it is the least recently used such block. So cached
blocks count as free: they are taken back before anything else gives way.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int, max_cached: int | None = None):
        """max_cached: unreferenced cached blocks kept at most (None: as many as fit; 0: no caching)."""
        self.num_blocks = num_blocks
        self.max_cached = num_blocks if max_cached is None else max_cached
        self._free = list(range(num_blocks - 1, -1, -1))  # blocks holding nothing of use
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # cached block → its prefix key
        self._block_of: dict[bytes, int] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones and unreferenced cached ones."""
        return len(self._free) + len(self._unused)

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix, referenced or not."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        """n blocks for new KV: empty ones first, then the least recently used cached ones."""
        if n > self.num_free:
            raise MemoryError(f"{n} KV blocks asked, {self.num_free} free")
        k = len(self._free) - min(n, len(self._free))
        taken = self._free[k:][::-1]
        del self._free[k:]
        while len(taken) < n:
            block, _ = self._unused.popitem(last=False)
            self._forget(block)
            taken.append(block)
        for b in taken:
            self._refs[b] = 1
        return taken

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a cached block nobody holds becomes evictable, the
        table's last block first (a prefix's tail is worth less than its head)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._key_of:
                self._unused[b] = None
            else:
                self._free.append(b)
        while len(self._unused) > self.max_cached:
            block, _ = self._unused.popitem(last=False)
            self._forget(block)
            self._free.append(block)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading keys, each now referenced once more."""
        blocks = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            self._refs[b] += 1
            self._unused.pop(b, None)
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """``blocks`` (held already) referenced once more: another table reads the same KV."""
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is shared but held by nobody"
            self._refs[b] += 1
        return list(blocks)

    def cache(self, block: int, key: bytes) -> None:
        """Publish a block that now holds the full KV of ``key`` (kept private if that key is cached already)."""
        if self.max_cached and key not in self._block_of and block not in self._key_of:
            self._key_of[block] = key
            self._block_of[key] = block

    def _forget(self, block: int) -> None:
        del self._block_of[self._key_of.pop(block)]

    def check(self) -> None:
        """Every block is exactly one of: free, cached and unreferenced, or referenced."""
        free, unused = set(self._free), set(self._unused)
        assert len(free) == len(self._free) and not free & unused
        for b in range(self.num_blocks):
            held = self._refs[b] > 0
            assert held + (b in free) + (b in unused) == 1, f"block {b} lost or double-booked"
            assert (b in unused) <= (b in self._key_of)
        assert all(self._block_of[k] == b for b, k in self._key_of.items())


def allocate_kv(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
    """Per layer (k, v), each [blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
