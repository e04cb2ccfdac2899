"""The cold load in a handful of large ops: safetensors bytes → one host buffer in the serving
dtype whose module stacks are strided views, with no per-matrix work.

A loader thread shares the GIL with the engine thread, and every torch call releases and
re-takes it: the per-matrix path (a 7B adapter has 448 matrices: a safetensors copy, a view, a
finite check and a stacked copy each, ~3,500 calls) waited for the GIL at each of them. Here:

- the header is parsed and checked once per layout (``Plan``; the same bytes for every adapter
  of a shape and rank, so later loads look it up), at least as strictly as the safetensors
  library (offsets tile the data section with no hole, sizes match dtype and shape, no
  duplicate key) — anything unusual is handed to the library path (``parse_weights``), which
  then gives its exact refusal or result;
- a file of one dtype (F16, BF16, F32) whose layers repeat at a fixed stride per module, in
  file order, is served from its own layout: the data section is checked for NaN/Inf with two
  integer reductions over its bits (the matrices tile it, so this is each matrix's check) and
  copied, converting, into the buffer with one copy; module stacks are strided views of it
  (B transposed by strides, the GPU pool transposes on the device). Layers are in file order
  (PEFT's files sort names: 0, 1, 10, 11, ...), ``ModuleStack.layers`` says which is which.

The check and the copy run in numpy, on the loader thread alone with the GIL released: a torch op
on a large CPU tensor starts an OpenMP team of every core for each calling thread, so eight loader
threads ran eight teams beside the engine thread (measured in benchmarks/adapter_cold_load.py).
Only a conversion to or from bfloat16, which numpy has no type for, is left to torch.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from adapters_store.manifest import AdapterManifest
from adapters_store.peft_weights import (
    LORA_KEY,
    LoraWeights,
    ModelShape,
    ModuleStack,
    module_dims,
    parse_weights,
    targets_of,
)

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}
# A value is NaN or ±Inf iff its exponent bits are all ones. Read as a signed integer such a
# positive value is ≥ the exponent field, read as an unsigned one such a negative value is ≥
# sign | field, and no finite value reaches either: two max-reductions, no temporary.
_NONFINITE = {
    torch.float16: (np.int16, np.uint16, 0x7C00, 0x8000),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0x8000),
    torch.float32: (np.int32, np.uint32, 0x7F800000, 0x80000000),
}
_MAX_HEADER = 100_000_000  # the safetensors library's limit
_MAX_PLANS = 64


@dataclass(frozen=True)
class View:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the data section's start


@dataclass(frozen=True)
class Plan:
    dtype: torch.dtype  # the file's
    data_start: int  # bytes: 8 + header length
    numel: int  # elements in the data section
    stacks: dict[str, tuple[tuple[int, ...], View, View]]  # module → (layers in file order, A, Bt)
    where: dict[tuple[int, str], tuple[str, int]]  # (layer, module) → (module, index in its stack)


def all_finite(data: np.ndarray, dtype: torch.dtype) -> bool:
    """data: the raw bytes (uint8) of `dtype` values → no NaN and no ±Inf among them."""
    signed, unsigned, field, sign = _NONFINITE[dtype]
    if data.size == 0:
        return True
    return int(data.view(signed).max()) < field and int(data.view(unsigned).max()) < sign | field


def copy_into(buf: torch.Tensor, data: np.ndarray, dtype: torch.dtype) -> None:
    """buf (CPU, contiguous, its own dtype) ← data, the raw bytes of `dtype` values, converting
    as torch does (round to nearest even; fp32 → fp16 overflows to ±Inf)."""
    if buf.dtype == dtype:
        np.copyto(buf.view(torch.uint8).numpy(), data)
    elif buf.dtype in _NUMPY and dtype in _NUMPY:
        np.copyto(buf.numpy(), data.view(_NUMPY[dtype]), casting="unsafe")
    else:
        buf.copy_(torch.from_numpy(data).view(dtype))


class PackedPairs(Mapping):
    """``LoraWeights.tensors`` of a fast-loaded adapter: (layer, module) → (A, B) views of its
    stacks, made when asked for (rarely: the GPU pool copies whole stacks)."""

    def __init__(self, stacks: dict[str, ModuleStack], where: dict[tuple[int, str], tuple[str, int]]):
        self._stacks, self._where = stacks, where

    def __getitem__(self, key):
        module, i = self._where[key]
        st = self._stacks[module]
        return st.A[i], st.Bt[i].T

    def __iter__(self) -> Iterator:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _header(raw: np.ndarray) -> tuple[dict, int] | None:
    """(entries, data start) if raw is a plain safetensors file the library would accept too."""
    if raw.nbytes < 8:
        return None
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    if n > _MAX_HEADER or 8 + n > raw.nbytes or n == 0 or raw[8] != ord("{"):
        return None
    try:
        header = json.loads(raw[8 : 8 + n].tobytes().decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(header, dict):
        return None
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        return None
    return header, 8 + n


def _is_uint(x) -> bool:
    return type(x) is int and x >= 0  # not bool, not float


def build_plan(raw: np.ndarray, shape: ModelShape, manifest: AdapterManifest) -> Plan | None:
    parsed = _header(raw)
    if parsed is None or shape.fused:
        return None
    header, start = parsed
    dtypes, spans = set(), []
    for key, info in header.items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
            return None
        dtype, dims, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES or not isinstance(dims, list) or not all(_is_uint(d) for d in dims):
            return None
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(o) for o in offs)):
            return None
        dtypes.add(dtype)
        numel = int(np.prod(dims, dtype=object)) if dims else 1
        if offs[1] - offs[0] != numel * _DTYPES[dtype].itemsize:
            return None
        spans.append((offs[0], offs[1], key, tuple(dims)))
    if len(dtypes) != 1 or not spans:
        return None
    dtype = _DTYPES[dtypes.pop()]
    spans.sort()
    at = 0
    for begin, end, _, _ in spans:  # the library's rule: contiguous from 0 to the end of the buffer
        if begin != at:
            return None
        at = end
    if start + at != raw.nbytes or start % dtype.itemsize:  # unaligned data: the library path copies it
        return None
    return _stacks(spans, dtype, start, at, shape, manifest)


def _stacks(spans, dtype, start, nbytes, shape: ModelShape, manifest: AdapterManifest) -> Plan | None:
    """The module stacks as strided views, if every check ``parse_weights`` makes passes and the
    layers repeat at one stride; else None (the library path then refuses or loads it)."""
    item, targets, rank = dtype.itemsize, targets_of(shape), manifest.rank
    found: dict[str, dict[int, dict[str, tuple[int, tuple[int, ...]]]]] = {}
    for begin, _, key, dims in spans:  # file order
        m = LORA_KEY.search(key)
        if m is None or m.group(2) not in targets or int(m.group(1)) >= shape.num_layers:
            return None
        pair = found.setdefault(m.group(2), {}).setdefault(int(m.group(1)), {})
        if m.group(3) in pair:  # two keys for one matrix (different prefixes)
            return None
        pair[m.group(3)] = (begin // item, dims)
    if manifest.target_modules is not None and not set(found) <= set(manifest.target_modules):
        return None
    stacks, where = {}, {}
    for module, layers in sorted(found.items(), key=lambda kv: min(kv[1])):
        d_in, d_out = module_dims(shape, module)
        if any(set(p) != {"A", "B"} for p in layers.values()):
            return None
        if any(p["A"][1] != (rank, d_in) or p["B"][1] != (d_out, rank) for p in layers.values()):
            return None
        order = sorted(layers, key=lambda layer: layers[layer]["A"][0])
        a_at = [layers[layer]["A"][0] for layer in order]
        b_at = [layers[layer]["B"][0] for layer in order]
        sa = a_at[1] - a_at[0] if len(order) > 1 else rank * d_in
        sb = b_at[1] - b_at[0] if len(order) > 1 else d_out * rank
        if any(a != a_at[0] + k * sa for k, a in enumerate(a_at)) or any(
            b != b_at[0] + k * sb for k, b in enumerate(b_at)
        ):
            return None
        n = len(order)
        a = View((n, rank, d_in), (sa, d_in, 1), a_at[0])
        bt = View((n, rank, d_out), (sb, 1, rank), b_at[0])  # B [out, r] read as [r, out]
        stacks[module] = (tuple(order), a, bt)
        where.update({(layer, module): (module, i) for i, layer in enumerate(order)})
    return Plan(dtype, start, nbytes // item, stacks, where)


class FastLoader:
    """Plans by header bytes (with the manifest's rank and targets) for one model shape."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self._plans: dict[tuple, Plan | None] = {}
        self._lock = threading.Lock()
        self.fallbacks = 0  # loads that took the library path (tests and the profile read it)

    def plan(self, raw: np.ndarray, manifest: AdapterManifest) -> Plan | None:
        if raw.nbytes < 8:
            return None
        (n,) = struct.unpack("<Q", raw[:8].tobytes())
        key = (raw[8 : 8 + min(n, _MAX_HEADER)].tobytes(), raw.nbytes, manifest.rank, manifest.target_modules)
        with self._lock:
            if key in self._plans:
                return self._plans[key]
        plan = build_plan(raw, self.shape, manifest)
        with self._lock:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def load(
        self,
        name: str,
        manifest: AdapterManifest,
        raw: np.ndarray,
        version: str,
        alloc: Callable[[int], torch.Tensor] | None,
    ) -> LoraWeights:
        """raw: the file (uint8, may be reused by the caller afterwards: nothing returned aliases
        it). alloc(numel) → the host buffer in the serving dtype; None: parse only (library path)."""
        plan = self.plan(raw, manifest) if alloc is not None else None
        if plan is not None:
            data = raw[plan.data_start :]
            if all_finite(data, plan.dtype):
                buf = alloc(plan.numel)
                copy_into(buf, data, plan.dtype)
                at = lambda v: buf.as_strided(v.size, v.stride, buf.storage_offset() + v.offset)  # noqa: E731
                stacks = {m: ModuleStack(layers, at(a), at(bt)) for m, (layers, a, bt) in plan.stacks.items()}
                return LoraWeights(name, version, manifest, PackedPairs(stacks, plan.where), buf, stacks)
        self.fallbacks += 1  # the library path: its refusal names the matrix (or it loads what we do not plan)
        return parse_weights(name, manifest, raw.tobytes(), self.shape, version)
