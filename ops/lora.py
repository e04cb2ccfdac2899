"""The LoRA add-on, dispatched by device: SGMV CUDA kernels on GPU, the fp32 reference elsewhere."""

from typing import NamedTuple

import torch

from ops.fixed_gemm import tiled_linear
from ops.fixed_order import current
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
        from ops.sgmv_plan import warm_up

        warm_up(dtype, max_rank, device)


def add_lora(y, x, slices, indptr, ranks, scales, host_segments=None):
    """y[seg, off:off+h_out] += scale[slot] * x[seg] @ A[slot].T @ B[slot] per segment and slice (slot −1 skips).

    y: [tokens, >= off + h_out] in place; x: [tokens, h_in]; slices: LoraSlice per member of a
    fused projection (one launch on CUDA for all of them); indptr: [segments + 1] int32.
    host_segments: per slice, the same segments as host tuples (lo, hi, slot, rank, scale); on
    the CPU they spare the per-call device→host reads of the reference, computing in x's dtype.
    """
    fixed = current().lora == "fixed_split"
    if x.is_cuda:
        from ops.sgmv import add_lora_sliced

        if fixed:  # one kernel shape whatever the batch: FIXED_SGMV
            return add_lora_sliced(y, x, slices, indptr, ranks, scales, **FIXED_SGMV)
        return add_lora_sliced(y, x, slices, indptr, ranks, scales)
    if fixed:
        return _add_fixed(y, x, slices, indptr, ranks, scales, host_segments, current().gemm_tile_rows)
    for i, s in enumerate(slices):
        if host_segments is None:
            lora_ref(y, x, s.A, s.B, indptr, s.slot_ids, ranks, scales, s.y_offset)
            continue
        cols = slice(s.y_offset, s.y_offset + s.B.shape[-1])
        for lo, hi, slot, r, scale in host_segments[i]:
            y[lo:hi, cols] += (x[lo:hi] @ s.A[slot, :r].T) @ s.B[slot, :r] * scale
    return y


# The SGMV launch of the fixed-order path (sm_90 only; app/engine/determinism.py refuses older GPUs).
# A row's shrink sums over k in an order set by the kernel's template: the cluster width (split-K),
# the warps per block and the k-steps each warp takes, which follow the rows per item (32-row
# items from 256 tokens on) and, in 4-warp blocks at rank tile 16, whether an item has <= 8 rows.
# Fixed here: clusters of 8, 8-warp blocks (no <= 8-row variant), 16-row items, no rank groups.
# Before sm_90 the <= 8-row variant runs in every block (4 warps only): no fixed order.
FIXED_SGMV = dict(split=8, warps=8, groups=1, small_items=True)


def prepare_fixed(dtype, max_rank: int, device) -> None:
    """Compile and load the fixed path's SGMV kernels now (not at a first use mid-capture)."""
    from ops.sgmv_plan import function, kernel_arch
    from ops.sgmv_shapes import FUSED, kernel_name

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    arch = kernel_arch(index)
    for sliced in (False, True):
        function(kernel_name(FUSED, dtype, max_rank, 1, arch, 8, 8, sliced)[0], index)


def _add_fixed(y, x, slices, indptr, ranks, scales, host_segments, tile: int):
    """The add-on's two products per segment as fixed-tile GEMMs (ops/fixed_gemm.py): a row's
    result depends neither on its segment's length nor on where the segment sits."""
    for i, s in enumerate(slices):
        segs = host_segments[i] if host_segments is not None else _host_segments(indptr, s.slot_ids, ranks, scales)
        cols = slice(s.y_offset, s.y_offset + s.B.shape[-1])
        for lo, hi, slot, r, scale in segs:
            v = tiled_linear(x[lo:hi], s.A[slot, :r], None, tile)
            y[lo:hi, cols] += tiled_linear(v, s.B[slot, :r].T, None, tile) * scale
    return y


def _host_segments(indptr, slot_ids, ranks, scales):
    bounds, slots = indptr.tolist(), slot_ids.tolist()
    return [
        (bounds[j], bounds[j + 1], slot, int(ranks[slot]), float(scales[slot]))
        for j, slot in enumerate(slots)
        if slot >= 0
    ]
