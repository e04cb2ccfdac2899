"""The LoRA add-on, dispatched by device: SGMV CUDA kernels on GPU, the fp32 reference elsewhere."""

from typing import NamedTuple

import torch

from ops.reference import lora_ref


class LoraSlice(NamedTuple):
    """One member of a fused projection: its pools, its segments' pool slots, its first column in y."""

    A: torch.Tensor  # [slots, max_rank, h_in]
    B: torch.Tensor  # [slots, max_rank, h_out]
    slot_ids: torch.Tensor  # [segments] int32, −1: the segment's adapter has no weights here
    y_offset: int


def prepare(dtype, max_rank: int, device) -> None:
    """Ready the kernels add_lora will run for a pool like this (CUDA: compiled and loaded now)."""
    if torch.device(device).type == "cuda":
        from ops.sgmv import warm_up

        warm_up(dtype, max_rank, device)


def add_lora(y, x, slices, indptr, ranks, scales, host_segments=None):
    """y[seg, off:off+h_out] += scale[slot] * x[seg] @ A[slot].T @ B[slot] per segment and slice (slot −1 skips).

    y: [tokens, >= off + h_out] in place; x: [tokens, h_in]; slices: LoraSlice per member of a
    fused projection (one launch on CUDA for all of them); indptr: [segments + 1] int32.
    host_segments: per slice, the same segments as host tuples (lo, hi, slot, rank, scale); on
    the CPU they spare the per-call device→host reads of the reference, computing in x's dtype.
    """
    if x.is_cuda:
        from ops.sgmv import add_lora_sliced

        return add_lora_sliced(y, x, slices, indptr, ranks, scales)
    for i, s in enumerate(slices):
        if host_segments is None:
            lora_ref(y, x, s.A, s.B, indptr, s.slot_ids, ranks, scales, s.y_offset)
            continue
        cols = slice(s.y_offset, s.y_offset + s.B.shape[-1])
        for lo, hi, slot, r, scale in host_segments[i]:
            y[lo:hi, cols] += (x[lo:hi] @ s.A[slot, :r].T) @ s.B[slot, :r] * scale
    return y
