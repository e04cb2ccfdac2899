"""Paged KV cache: fixed-size blocks, blocks outermost, per-request block tables.

A request owns a list of block ids; joining or leaving allocates or frees ids,
never copies KV.
"""
from __future__ import annotations

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks asked, {len(self._free)} free")
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def allocate_kv(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
    """Per layer (k, v), each [blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
