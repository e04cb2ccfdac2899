"""Launches of kernels/small_ops.cu: RMSNorm (+ residual add), SwiGLU, GeGLU, RoPE + KV write.

One launch each instead of the 3-8 torch kernels of the eager ops (`ops.norms`, `ops.rope`,
`ops.activation` dispatch here for fp16/bf16 CUDA tensors); they round as those ops do.
NVRTC is loaded on first launch only. Nothing here allocates except outputs, reads device
memory on the host, or synchronizes.
"""

import ctypes

import torch

_CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_DIMS = (64, 128)


class _NormArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("h", "delta", "weight", "out")]
    _fields_ += [
        ("h_stride", ctypes.c_longlong),
        ("delta_stride", ctypes.c_longlong),
        ("hidden", ctypes.c_int),
        ("eps", ctypes.c_float),
    ]


class _SiluMulArgs(ctypes.Structure):
    _fields_ = [
        ("gate_up", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("total", ctypes.c_longlong),
        ("inter", ctypes.c_int),
    ]


class _RopeKvArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("qkv", "cos", "sin", "k_cache", "v_cache", "slots")]
    _fields_ += [("qkv_stride", ctypes.c_longlong), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int)]


NORM_MAX_HIDDEN = 256 * 8 * 4  # kNormVecs in kernels/small_ops.cu


def usable(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _CTYPE


def norm_usable(x: torch.Tensor) -> bool:
    """rms_norm's kernel holds a row in registers: hidden a multiple of 8, at most NORM_MAX_HIDDEN."""
    return usable(x) and x.shape[-1] % 8 == 0 and x.shape[-1] <= NORM_MAX_HIDDEN


def all_kernel_names() -> list[str]:
    """Every instantiation launched here (CI compiles them for sm_80 and sm_90)."""
    names = []
    for c in _CTYPE.values():
        names += [
            f"rms_norm_kernel<{c}, false>",
            f"rms_norm_kernel<{c}, true>",
            f"silu_mul_kernel<{c}>",
            f"gelu_tanh_mul_kernel<{c}>",
        ]
        names += [f"rope_kv_kernel<{c}, {d}>" for d in HEAD_DIMS]
    return names


def _run(name: str, grid: int, threads: int, args, device: torch.device):
    from . import launch as _launch  # not at import: CPU-only processes never load NVRTC
    from . import nvrtc

    index = torch.cuda.current_device() if device.index is None else device.index
    _launch.launch(nvrtc.load_function("small_ops.cu", name, index), grid, threads, args, device)


def rms_norm(h, weight, eps: float, delta=None):
    """weight * T(h' * rsqrt(mean(h'^2) + eps)) with h' = h, or h' = T(h + delta) stored into h.

    h: [tokens, hidden] (rows unit-stride; updated in place when delta is given); delta: like h;
    weight: [hidden]. Returns a new contiguous [tokens, hidden].
    """
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if h.shape[0] == 0:
        return out
    if h.stride(1) != 1 or h.stride(0) % 8 or (delta is not None and (delta.stride(1) != 1 or delta.stride(0) % 8)):
        raise ValueError("rms_norm: rows must be unit-stride, 16-byte aligned")
    if not norm_usable(h):
        raise ValueError(f"rms_norm: hidden {h.shape[1]} not a multiple of 8 up to {NORM_MAX_HIDDEN}")
    args = _NormArgs(
        h=h.data_ptr(),
        delta=None if delta is None else delta.data_ptr(),
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        h_stride=h.stride(0),
        delta_stride=0 if delta is None else delta.stride(0),
        hidden=h.shape[1],
        eps=eps,
    )
    _run(
        f"rms_norm_kernel<{_CTYPE[h.dtype]}, {'true' if delta is not None else 'false'}>",
        h.shape[0],
        256,
        args,
        h.device,
    )
    return out


def _gated(kernel: str, gate_up):
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    total = tokens * inter
    if total == 0:
        return out
    if not gate_up.is_contiguous():
        raise ValueError(f"{kernel}: gate_up must be contiguous")
    args = _SiluMulArgs(gate_up=gate_up.data_ptr(), out=out.data_ptr(), total=total, inter=inter)
    _run(f"{kernel}<{_CTYPE[gate_up.dtype]}>", min(-(-total // 256), 65536), 256, args, gate_up.device)
    return out


def silu_mul(gate_up):
    """T(T(silu(gate)) * up) for gate_up = [gate | up]: [tokens, 2 * inter] contiguous → [tokens, inter]."""
    return _gated("silu_mul_kernel", gate_up)


def gelu_tanh_mul(gate_up):
    """T(T(gelu_tanh(gate)) * up) for gate_up = [gate | up]: [tokens, 2 * inter] contiguous → [tokens, inter]."""
    return _gated("gelu_tanh_mul_kernel", gate_up)


def rope_kv(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, head_dim: int):
    """RoPE (half rotation, x * cos + rotate_half(x) * sin) on q and k of qkv in place, then
    k_cache/v_cache[slots[t]] = k[t], v[t] (slots < 0 skipped).

    qkv: [tokens, (heads + 2 * kv_heads) * head_dim] (rows unit-stride); cos, sin: [tokens,
    head_dim] contiguous, qkv's dtype; caches: [blocks, block_size, kv_heads, head_dim]
    contiguous; slots: [tokens] int32 flat slot (block * block_size + offset).
    """
    if qkv.shape[0] == 0:
        return
    if slots.dtype != torch.int32 or qkv.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_kv: int32 slots, unit-stride qkv rows, contiguous cos/sin")
    if head_dim not in HEAD_DIMS or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(f"rope_kv: head_dim {head_dim} unsupported or caches not contiguous")
    args = _RopeKvArgs(
        qkv=qkv.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        slots=slots.data_ptr(),
        qkv_stride=qkv.stride(0),
        heads=heads,
        kv_heads=kv_heads,
    )
    _run(f"rope_kv_kernel<{_CTYPE[qkv.dtype]}, {head_dim}>", qkv.shape[0], 512, args, qkv.device)


def warm_up(dtype: torch.dtype, device) -> None:
    """Compile (or read from the disk cache) and load every kernel here for dtype now."""
    from . import nvrtc

    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    for name in all_kernel_names():
        if f"<{_CTYPE[dtype]}," in name or f"<{_CTYPE[dtype]}>" in name:
            nvrtc.load_function("small_ops.cu", name, index)
