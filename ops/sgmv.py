"""SGMV LoRA kernels (Punica): one launch applies a different adapter to each segment of rows.

Layouts are those of `ops.reference`: pools ``A [slots, max_rank, h_in]`` and
``B [slots, max_rank, h_out]`` in the activation dtype (fp16 or bf16,
contiguous), ``ranks [slots]`` int32 and ``scales [slots]`` float32; a batch is
cut into segments ``indptr [nseg+1]`` int32 with ``slot_ids [nseg]`` int32
(-1 = no adapter, the rows are left alone). All are CUDA tensors; nothing here
reads them on the host, allocates, or synchronizes, so every call can be
captured in a CUDA graph. Kernels are picked from host-known shapes only
(``x.shape``, ``indptr.numel()``, the pool's max rank) and compiled by NVRTC on
first use (`ops.nvrtc`). Requirements, checked: h_in, h_out, row strides and
``y_offset`` multiples of 8 elements (16-byte vectors), max_rank <= 128.
"""

import ctypes
import functools
from typing import NamedTuple

import torch

from . import launch as _launch
from . import nvrtc, reference
from .sgmv_shapes import (  # noqa: F401 (API)
    EXPAND,
    FUSED,
    GX_PER_SM,
    SHRINK,
    SPLIT,
    all_kernel_names,
    fused_kernel_names,
    fused_shape,
    kernel_name,
)


class _Args(ctypes.Structure):
    """Mirror of `SgmvArgs` in kernels/args.cuh."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("x", "y", "v", "A", "B", "indptr", "slot_ids", "ranks", "scales")]
    _fields_ += [(n, ctypes.c_longlong) for n in ("x_stride", "y_stride", "v_stride", "a_slot", "b_slot")]
    _fields_ += [(n, ctypes.c_int) for n in ("nseg", "tokens", "h_in", "h_out", "max_rank", "slots")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("xpart", "xcount")]


class _Slice(ctypes.Structure):
    """Mirror of `SliceArgs` in kernels/args.cuh."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("A", "B", "slot_ids")]
    _fields_ += [(n, ctypes.c_int) for n in ("y_shift", "b_slot", "h_out")]


MAX_SLICES = 3  # SgmvSlices: the base's slice and two more (q|k|v)


class _Slices(ctypes.Structure):
    """Mirror of `SgmvSlices` in kernels/args.cuh."""

    _fields_ = [("base", _Args), ("more", _Slice * (MAX_SLICES - 1))]


@functools.cache
def _exchange_workspace(device: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K without clusters: a partial (32 rows x rank 128, fp32) per block the GPU may hold
    at once, and a counter per item (kernels/exchange.cuh); rank groups use the counters and a
    little of the space. One per device, so add-ons that use it must not run concurrently on
    two streams (the engine runs one)."""
    blocks = int(max(GX_PER_SM.values()) * _sm_count(device))
    return (
        torch.empty(blocks * 32 * 128, dtype=torch.float32, device=f"cuda:{device}"),
        torch.zeros(blocks, dtype=torch.int32, device=f"cuda:{device}"),
    )


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def _function(name: str, device_index: int):
    """Kernel `name` built for the arch the wrappers pick kernels for (_arch)."""
    return nvrtc.load_function("sgmv.cu", name, device_index, arch=_arch(device_index))


@functools.cache
def _clusters_at_once(name: str, device_index: int, cluster: int, threads: int) -> int:
    """How many clusters of kernel `name` the device holds at once."""
    return _launch.max_active_clusters(_function(name, device_index), cluster, threads)


def warm_up(dtype: torch.dtype, max_rank: int, device) -> None:
    """Compile (or read from the disk cache) and load those kernels now, so that no step
    stalls on a first use."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    for name in fused_kernel_names(dtype, max_rank, _arch(index)):
        _function(name, index)
    _exchange_workspace(index)  # split-K through L2 (sm_80) and rank groups (sm_90): not allocated mid-capture


def _check(x, pool, y, v, segs, y_offset=0):
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


def _ptr(t, offset=0):
    return None if t is None else t.data_ptr() + offset * t.element_size()


class Plan(NamedTuple):
    """One kernel launch: which instantiation, its grid (`blocks`, `cluster` per item: one
    thread-block cluster on sm_90; by `slices`), its arguments, on which device."""

    name: str
    blocks: int
    threads: int
    args: _Args | _Slices
    device: torch.device
    cluster: int
    slices: int = 1


def launch_plan(
    mode,
    tokens,
    *,
    x=None,
    y=None,
    v=None,
    A=None,
    B=None,
    indptr,
    slot_ids,
    ranks,
    scales=None,
    y_offset=0,
    split=None,
    warps=None,
    groups=None,
    more=(),
    small_items=False,
) -> Plan | None:
    """The launch of one call, or None when there is nothing to do; split / warps / groups None:
    the measured defaults (forced by the benchmark and the tests); more: the slices after
    the first of a sliced add-on (FUSED; the first is A, B, slot_ids, y_offset); small_items:
    16-row items whatever the token count (the fixed-order path: 32-row items split k otherwise)."""
    pool = A if A is not None else B
    dev, arch, nseg, max_rank = pool.device, _arch(pool.device.index), slot_ids.numel(), pool.shape[1]
    if nseg == 0 or tokens == 0:
        return None
    tile_tokens = 1 if small_items else tokens  # kernel_name reads tokens only to pick the item rows
    rows = kernel_name(mode, pool.dtype, max_rank, tile_tokens, arch)[2]
    items = nseg + (tokens + rows - 1) // rows - 1  # per slice: kernels/segments.cuh
    total = items * (1 + len(more))
    shape = (
        fused_shape(total, rows, max_rank, arch, _sm_count(dev.index), tokens * (1 + len(more)))
        if mode == FUSED
        else (SPLIT, 4, 1)
    )
    if groups is None:  # a forced split or warps: in one cluster per item
        groups = shape[2] if split is None and warps is None else 1
    if rows != 16:
        groups = 1  # rank groups: decode tiles only
    split = shape[0] if split is None else split
    warps = shape[1] if warps is None else warps
    exchange = mode == FUSED and arch < 90
    if exchange and total * split > GX_PER_SM[rows] * _sm_count(dev.index):
        split = 1  # forced: not past what the GPU holds at once, or peers could wait on unscheduled blocks
    name, split, rows, warps = kernel_name(
        mode, pool.dtype, max_rank, tile_tokens, arch, split, warps, bool(more), groups
    )
    if groups > 1 and total * groups > _clusters_at_once(name, dev.index, split, 32 * warps):
        # the clusters of an item wait for each other: never past what the GPU holds at once
        groups = 1
        name, split, rows, warps = kernel_name(mode, pool.dtype, max_rank, tile_tokens, arch, split, warps, bool(more))
    xpart, xcount = _exchange_workspace(dev.index) if (exchange and split > 1) or groups > 1 else (None, None)
    args = _Args(
        x=_ptr(x),
        y=_ptr(y, y_offset),
        v=_ptr(v),
        A=_ptr(A),
        B=_ptr(B),
        indptr=_ptr(indptr),
        slot_ids=_ptr(slot_ids),
        ranks=_ptr(ranks),
        scales=_ptr(scales),
        x_stride=0 if x is None else x.stride(0),
        y_stride=0 if y is None else y.stride(0),
        v_stride=0 if v is None else v.stride(0),
        a_slot=0 if A is None else A.stride(0),
        b_slot=0 if B is None else B.stride(0),
        nseg=nseg,
        tokens=tokens,
        h_in=0 if A is None else A.shape[2],
        h_out=0 if B is None else B.shape[2],
        max_rank=max_rank,
        slots=ranks.numel(),
        xpart=_ptr(xpart),
        xcount=_ptr(xcount),
    )
    if more:
        args = _Slices(
            args,
            (_Slice * (MAX_SLICES - 1))(
                *(
                    _Slice(
                        A=_ptr(s.A),
                        B=_ptr(s.B),
                        slot_ids=_ptr(s.slot_ids),
                        y_shift=s.y_offset - y_offset,
                        b_slot=s.B.stride(0),
                        h_out=s.B.shape[2],
                    )
                    for s in more
                )
            ),
        )
    return Plan(name, items * groups * split, 32 * warps, args, dev, split, 1 + len(more))


def _run(mode, tokens, **kwargs):
    p = launch_plan(mode, tokens, **kwargs)
    if p is not None:
        _launch.launch(_function(p.name, p.device.index), p.blocks, p.threads, p.args, p.device, grid_y=p.slices)


def sgmv_shrink(v, x, A, indptr, slot_ids, ranks):
    """v[s_i:s_{i+1}, :r_i] = x[s_i:s_{i+1}] @ A[slot_i, :r_i].T for every segment i with slot_i >= 0.

    v: [tokens, >= max_rank] float32, written in place only in the
    rows of segments with an adapter and columns < that adapter's rank.
    x: [tokens, h_in] fp16/bf16; A: [slots, max_rank, h_in]. Returns v.
    Split-K over h_in across a cluster of 8 blocks (sm_90). CPU: the reference.
    """
    if not x.is_cuda:
        return reference.sgmv_shrink_ref(v, x, A, indptr, slot_ids, ranks)
    _check(x, A, x, v, (indptr, slot_ids, ranks))
    _run(SHRINK, x.shape[0], x=x, v=v, A=A, indptr=indptr, slot_ids=slot_ids, ranks=ranks)
    return v


def sgmv_expand(y, v, B, indptr, slot_ids, ranks, scales, y_offset=0):
    """y[s_i:s_{i+1}, off:off+h_out] += scale_i * v[s_i:s_{i+1}, :r_i] @ B[slot_i, :r_i] (slot_i >= 0).

    y: [tokens, >= y_offset + h_out] fp16/bf16, updated in place (row stride
    y.stride(0), so y may be a fused q|k|v or gate|up output); v: [tokens,
    >= max_rank] float32, read up to each adapter's rank;
    B: [slots, max_rank, h_out]. Accumulates in fp32, rounds once. Returns y.
    """
    if not y.is_cuda:
        return reference.sgmv_expand_ref(y, v, B, indptr, slot_ids, ranks, scales, y_offset)
    _check(y, B, y, v, (indptr, slot_ids, ranks, scales), y_offset)
    _run(
        EXPAND,
        y.shape[0],
        y=y,
        v=v,
        B=B,
        indptr=indptr,
        slot_ids=slot_ids,
        ranks=ranks,
        scales=scales,
        y_offset=y_offset,
    )
    return y


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

    The whole LoRA add-on in one launch: a cluster of 16, 8 or 4 blocks (by grid
    size: see ops/sgmv_shapes.py) per work item splits h_in for the
    shrink, sums the partial v in distributed shared memory, then splits h_out
    for the expand (sm_90; before it, the partials meet in L2). A grid of at most 4
    items at rank tiles 64 and 128 (rank groups, sm_90): 4 clusters per item,
    each summing a quarter of v's ranks, which they trade through a per-device
    workspace in L2.
    y: [tokens, >= y_offset + h_out] fp16/bf16 updated in place (row stride
    y.stride(0)); x: [tokens, h_in]; A: [slots, max_rank, h_in];
    B: [slots, max_rank, h_out]. Otherwise v never leaves the chip, so the
    caller passes no scratch; pass v (float32 [tokens, >= max_rank]) to also
    receive x @ A.T as sgmv_shrink writes it. split (cluster width), warps (per
    block) and groups (clusters per item) override the measured defaults (for the
    benchmark's sweep and the tests). Returns y.
    """
    if not x.is_cuda:
        if v is not None:
            reference.sgmv_shrink_ref(v, x, A, indptr, slot_ids, ranks)
        return reference.lora_ref(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset)
    _check(x, A, y, v, (indptr, slot_ids, ranks, scales), y_offset)
    _check(x, B, y, None, (), y_offset)
    _run(
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
    """add_lora for every slice (A, B, slot_ids, y_offset) of a fused projection, in one launch.

    For each slice: y[s_i:s_{i+1}, off:off+h_out] += scale_i * x[s_i:s_{i+1}] @ A[slot_i, :r_i].T
    @ B[slot_i, :r_i] with that slice's slot ids (slot −1: not in this member) and columns.
    slices: 1..MAX_SLICES `ops.lora.LoraSlice`s; A pools alike ([slots, max_rank, h_in]); B pools
    [slots, max_rank, h_out of the slice]; ranks, scales and the segments are shared. One
    launch instead of one per member: one launch gap, one index round trip and one tail
    (benchmarks/sgmv.py, sliced); rank groups, split, warps and groups as in add_lora, over
    the items of all slices. Returns y.
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
        _check(x, s.A, y, None, (indptr, s.slot_ids, ranks, scales), s.y_offset)
        _check(x, s.B, y, None, (), s.y_offset)
    _run(
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
