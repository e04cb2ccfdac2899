"""The SGMV LoRA add-on (Punica): one launch applies a different adapter to each segment of rows.

Layouts are those of `ops.reference`: pools ``A [slots, max_rank, h_in]`` and
``B [slots, max_rank, h_out]`` in the activation dtype (fp16 or bf16,
contiguous), ``ranks [slots]`` int32 and ``scales [slots]`` float32; a batch is
cut into segments ``indptr [nseg+1]`` int32 with ``slot_ids [nseg]`` int32
(-1 = no adapter, the rows are left alone). All are CUDA tensors; nothing here
reads them on the host, allocates, or synchronizes, so every call can be
captured in a CUDA graph. `ops.sgmv_plan` picks the kernel from host-known shapes
only (``x.shape``, ``indptr.numel()``, the pool's max rank) and launches it.
Requirements, checked: h_in, h_out, row strides and ``y_offset`` multiples of 8
elements (16-byte vectors), max_rank <= 128.
"""

import torch

from . import reference
from .sgmv_plan import MAX_SLICES, launch
from .sgmv_shapes import FUSED


def check_operands(x, pool, y, v, segs, y_offset=0):
    """Refuse operands the kernels cannot read (module docstring), naming the rule."""
    if pool.dtype not in (torch.float16, torch.bfloat16) or x.dtype != pool.dtype or y.dtype != pool.dtype:
        raise TypeError(f"x, pool and y must share fp16/bf16, got {x.dtype}, {pool.dtype}, {y.dtype}")
    if v is not None and (v.dtype != torch.float32 or v.stride(-1) != 1 or v.device != pool.device):
        raise TypeError("v must be float32 with unit column stride, on the pool's device")
    if not pool.is_contiguous() or x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("pools must be contiguous, x and y rows unit-stride")
    if pool.shape[-1] % 8 or x.stride(0) % 8 or y.stride(0) % 8 or y_offset % 8:
        raise ValueError("h, row strides and y_offset must be multiples of 8 elements")
    if 32 * y.stride(0) >= 2**31 or pool.shape[1] * pool.shape[2] >= 2**31:
        raise ValueError("a 32-row tile of y or one pool slot spans 2**31 elements or more")  # int offsets in kernels
    for t, dt in zip(segs, (torch.int32, torch.int32, torch.int32, torch.float32)):
        if t.dtype != dt or not t.is_contiguous() or t.device != pool.device:
            raise TypeError(f"indptr, slot_ids, ranks, scales must be contiguous {dt} on {pool.device}")


def add_lora(
    y,
    x,
    A,
    B,
    indptr,
    slot_ids,
    ranks,
    scales,
    y_offset=0,
    v=None,
    *,
    split=None,
    warps=None,
    groups=None,
    small_items=False,
):
    """y[s_i:s_{i+1}, off:off+h_out] += scale_i * x[s_i:s_{i+1}] @ A[slot_i, :r_i].T @ B[slot_i, :r_i].

    y: [tokens, >= y_offset + h_out] fp16/bf16, updated in place (row stride y.stride(0), so y
    may be a fused q|k|v or gate|up output); x: [tokens, h_in], y's dtype; A: [slots, max_rank,
    h_in]; B: [slots, max_rank, h_out]. v (float32 [tokens, >= max_rank]), when given, also
    receives x @ A.T; otherwise v never leaves the chip and the caller passes no scratch.
    Returns y. On the CPU: the fp32 reference.

    One launch: a cluster of 16, 8 or 4 blocks (by grid size: ops/sgmv_shapes.py) per work item
    splits h_in for the shrink, sums the partial v in distributed shared memory, then splits
    h_out for the expand (sm_90; before it, the partials meet in L2). A grid of at most 4 items
    at rank tiles 64 and 128 (rank groups, sm_90): 4 clusters per item, each summing a quarter
    of v's ranks, which they trade through a per-device workspace in L2. split (cluster width),
    warps (per block), groups (clusters per item) and small_items (16-row items whatever the
    token count) override the measured defaults (the benchmark's sweep, the tests, and the
    fixed-order path).
    """
    if not x.is_cuda:
        if v is not None:
            reference.sgmv_shrink_ref(v, x, A, indptr, slot_ids, ranks)
        return reference.lora_ref(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset)
    check_operands(x, A, y, v, (indptr, slot_ids, ranks, scales), y_offset)
    check_operands(x, B, y, None, (), y_offset)
    launch(
        FUSED,
        x.shape[0],
        x=x,
        y=y,
        v=v,
        A=A,
        B=B,
        indptr=indptr,
        slot_ids=slot_ids,
        ranks=ranks,
        scales=scales,
        y_offset=y_offset,
        split=split,
        warps=warps,
        groups=groups,
        small_items=small_items,
    )
    return y


def add_lora_sliced(y, x, slices, indptr, ranks, scales, *, split=None, warps=None, groups=None, small_items=False):
    """For each slice: y[s_i:s_{i+1}, off:off+h_out] += scale_i * x[s_i:s_{i+1}] @ A[slot_i, :r_i].T
    @ B[slot_i, :r_i], with that slice's slot ids (slot -1: not in this member) and columns.

    slices: 1..MAX_SLICES `ops.lora.LoraSlice`s (A, B, slot_ids, y_offset) of one fused
    projection; A pools alike ([slots, max_rank, h_in]); B pools [slots, max_rank, h_out of the
    slice]; ranks, scales and the segments shared; dtypes as in add_lora. Returns y.

    One launch for every member instead of one each: one launch gap, one index round trip and one
    tail (benchmarks/sgmv_sliced.py); rank groups, split, warps and groups as in add_lora, over
    the items of all slices.
    """
    if not 1 <= len(slices) <= MAX_SLICES:
        raise ValueError(f"1..{MAX_SLICES} slices, got {len(slices)}")
    first = slices[0]
    if len(slices) == 1 or not x.is_cuda:
        for s in slices:
            add_lora(
                y,
                x,
                s.A,
                s.B,
                indptr,
                s.slot_ids,
                ranks,
                scales,
                s.y_offset,
                split=split,
                warps=warps,
                groups=groups,
                small_items=small_items,
            )
        return y
    for s in slices:
        if s.A.shape != first.A.shape or s.B.shape[:2] != first.B.shape[:2] or s.slot_ids.shape != first.slot_ids.shape:
            raise ValueError("slices must share the pools' slots, max rank and h_in, and the segments")
        check_operands(x, s.A, y, None, (indptr, s.slot_ids, ranks, scales), s.y_offset)
        check_operands(x, s.B, y, None, (), s.y_offset)
    launch(
        FUSED,
        x.shape[0],
        x=x,
        y=y,
        A=first.A,
        B=first.B,
        indptr=indptr,
        slot_ids=first.slot_ids,
        ranks=ranks,
        scales=scales,
        y_offset=first.y_offset,
        split=split,
        warps=warps,
        groups=groups,
        more=tuple(slices[1:]),
        small_items=small_items,
    )
    return y
