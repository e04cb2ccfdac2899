"""How one SGMV call is launched: the kernel instantiation and grid for a call's host-known
shapes (`launch_plan`, with `ops.sgmv_shapes`' measured defaults), the argument structs the
kernels read (kernels/args.cuh), the per-device split-K workspace, and the launch itself.
Kernels are compiled by NVRTC on first use (`ops.nvrtc`), or ahead by `warm_up`.
"""

import ctypes
import functools
from typing import NamedTuple

import torch

from . import launch as _launch
from . import nvrtc
from .sgmv_shapes import FUSED, GX_PER_SM, SPLIT, fused_kernel_names, fused_shape, kernel_name


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
def kernel_arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def function(name: str, device_index: int):
    """Kernel `name` built for the arch the plans pick kernels for (kernel_arch)."""
    return nvrtc.load_function("sgmv.cu", name, device_index, arch=kernel_arch(device_index))


@functools.cache
def _clusters_at_once(name: str, device_index: int, cluster: int, threads: int) -> int:
    """How many clusters of kernel `name` the device holds at once."""
    return _launch.max_active_clusters(function(name, device_index), cluster, threads)


def warm_up(dtype: torch.dtype, max_rank: int, device) -> None:
    """Compile (or read from the disk cache) and load now every fused kernel a pool of this dtype
    and max rank may launch, and allocate the split-K workspace, so that no step stalls on a
    first use (nor allocates mid-capture)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    for name in fused_kernel_names(dtype, max_rank, kernel_arch(index)):
        function(name, index)
    _exchange_workspace(index)  # split-K through L2 (sm_80) and rank groups (sm_90)


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
    dev, arch, nseg, max_rank = pool.device, kernel_arch(pool.device.index), slot_ids.numel(), pool.shape[1]
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


def launch(mode, tokens, **kwargs) -> None:
    """Plan the call (launch_plan's arguments) and launch it on the current stream."""
    p = launch_plan(mode, tokens, **kwargs)
    if p is not None:
        _launch.launch(function(p.name, p.device.index), p.blocks, p.threads, p.args, p.device, grid_y=p.slices)
