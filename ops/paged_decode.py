"""Launches of the paged decode attention kernel (kernels/attention.cu): one query per sequence
over its paged KV, a block per (sequence, KV head, split) serving all the KV head's query heads.

Which kernel: `paged_decode_kernel<T, D, WARPS, STAGES>`, the group size (1..8) a run-time
argument. Each warp streams its tiles through STAGES shared-memory stages of TILE tokens: the
copies in flight are what keeps HBM busy, so STAGES is as deep as two blocks per SM allow on
sm_90 (one at head dim 256) and what sm_80's 163 KB per block allows. Splits of a (sequence, KV
head) meet through fp32 partials and a per-pair counter (`_counters`, one per device: launches
on one device must be stream-ordered, as the engine's are).
"""

import ctypes
import functools

import torch

HEAD_DIMS = (64, 96, 128, 256)  # Llama 3.2 1B / Qwen2.5 0.5B, Phi-3, most, Gemma 2 and 3
MAX_GROUP = 8  # query heads per KV head a block serves: the MMA's 8 columns
TILE = 16  # tokens a warp takes at once (kTile); block_size must be a multiple
WARPS = 4
MAX_SPLITS = 16
COUNTERS = 1 << 16  # (sequence, KV head) pairs whose splits can meet in one launch
_CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
SMEM_LIMIT = {80: 163 << 10, 90: 227 << 10}  # dynamic shared memory a block may opt into


class _DecodeArgs(ctypes.Structure):
    """Mirror of `DecodeArgs` in kernels/attention.cu."""

    _fields_ = [
        (n, ctypes.c_void_p)
        for n in ("q", "out", "k_cache", "v_cache", "block_tables", "context_lens", "part_acc", "part_ml", "counters")
    ]
    _fields_ += [(n, ctypes.c_longlong) for n in ("q_stride", "out_stride")]
    _fields_ += [(n, ctypes.c_int) for n in ("table_stride", "heads", "kv_heads", "group", "block_size", "splits")]
    _fields_ += [("scale", ctypes.c_float), ("window", ctypes.c_int), ("softcap", ctypes.c_float)]


def supported(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, block_size: int = 16) -> bool:
    return (
        dtype in _CTYPE
        and head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and block_size % TILE == 0
    )


def stages(head_dim: int, arch: int) -> int:
    """Stages of each warp's ring (smem_bytes: 96 KB at head dim 128, two blocks per SM)."""
    if head_dim == 256:
        return 3 if arch >= 90 else 2  # 192 KB (one block per SM) fits sm_90's 227 KB, not sm_80's 163
    return 4 if head_dim == 64 else 3


def smem_bytes(head_dim: int, warps: int, n_stages: int) -> int:
    """Mirror of smem_bytes() in kernels/attention.cu (the kernel traps if given less)."""
    chunks = 2 * (head_dim // 32) + 4 * -(-head_dim // 64)  # 16-byte chunks a lane holds per tile
    return max(warps * n_stages * chunks * 32 * 16, (warps * 8 * (head_dim + 2) + 1) * 4)


def variants(head_dim: int, arch: int) -> list[tuple[int, int]]:
    """(warps, stages) pairs that fit `arch`'s shared memory (benchmarks/attention.py times them)."""
    pairs = [(2, 2), (2, 4), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3)]
    return [(w, s) for w, s in pairs if smem_bytes(head_dim, w, s) <= SMEM_LIMIT[min(arch, 90)]]


def kernel_name(dtype: torch.dtype, head_dim: int, arch: int, warps: int = WARPS, n_stages: int | None = None) -> str:
    n_stages = stages(head_dim, arch) if n_stages is None else n_stages
    return f"paged_decode_kernel<{_CTYPE[dtype]}, {head_dim}, {warps}, {n_stages}>"


def all_kernel_names(arch: int) -> list[str]:
    """Every instantiation the wrapper launches on `arch` (CI compiles them for sm_80 and sm_90)."""
    return sorted(kernel_name(dt, d, arch) for dt in _CTYPE for d in HEAD_DIMS)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _arch(device: int) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _index(device) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def decode_splits(seqs: int, kv_heads: int, device) -> int:
    """Splits per (sequence, KV head): as many as leave no multiprocessor without a block, at most
    MAX_SPLITS; a function of the batch shape only (a captured graph keeps its grid). Measured on
    the H200 (benchmarks/results/attention_h200.json, 32 sequences, 128–1,024 pairs on 132 SMs): one
    split was the fastest at every context 256–4096 and head layout, and 2–3 splits (two or more
    blocks per SM) cost 4–60 % more; more pairs than SMs never split."""
    pairs = max(1, seqs * kv_heads)
    if pairs > COUNTERS:
        return 1
    return max(1, min(MAX_SPLITS, _sms(_index(device)) // pairs))


_counter_buffers: dict[int, torch.Tensor] = {}


def _counters(index: int) -> torch.Tensor:
    """Zeros between launches (the last split of each pair resets its own); allocated outside
    any graph capture, since a captured zero-fill would run only at replay."""
    buf = _counter_buffers.get(index)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged_decode: call warm_up() (or run it once) before capturing a CUDA graph")
        buf = _counter_buffers[index] = torch.zeros(COUNTERS, dtype=torch.int32, device=f"cuda:{index}")
    return buf


@functools.cache
def _function(name: str, index: int, arch: int, smem: int):
    """The kernel, allowed `smem` bytes of dynamic shared memory (over 48 KB needs the opt-in)."""
    from . import nvrtc  # not at import: CPU-only processes never load NVRTC

    func = nvrtc.load_function("attention.cu", name, index, arch=arch)
    nvrtc.allow_dynamic_smem(func, index, smem, name)
    return func


def _config(head_dim: int, index: int, arch: int | None, config: tuple[int, int] | None):
    arch = _arch(index) if arch is None else arch
    warps, n_stages = config or (WARPS, stages(head_dim, arch))
    smem = smem_bytes(head_dim, warps, n_stages)
    if smem > SMEM_LIMIT[min(arch, 90)]:
        raise ValueError(f"paged_decode: {warps} warps x {n_stages} stages need {smem} bytes of shared memory")
    return arch, warps, n_stages, smem


def warm_up(dtype: torch.dtype, head_dim: int, group: int, device) -> None:
    """Compile (or read from the disk cache) and load the decode kernel, and allocate the split
    counters, now (not mid-capture, not mid-serving)."""
    index = _index(device)
    arch, warps, n_stages, smem = _config(head_dim, index, None, None)
    _function(kernel_name(dtype, head_dim, arch, warps, n_stages), index, arch, smem)
    _counters(index)


def paged_decode(
    out,
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    splits: int,
    window: int | None = None,
    softcap: float | None = None,
    *,
    arch: int | None = None,
    config: tuple[int, int] | None = None,
):
    """out[s, h] = softmax(q[s, h] · K[s]ᵀ · scale) · V[s] over the first context_lens[s] tokens
    of sequence s's blocks (the last `window` of them with a window), K/V head h // (heads /
    kv_heads); a row of length 0 gets zeros. softcap: scores softcap · tanh(score / softcap).

    out: [seqs, heads, D] written in place (row stride free, unit elsewhere); q: [seqs, heads, D]
    alike; caches: [blocks, block_size, kv_heads, D] contiguous, q's dtype (fp16/bf16), D in
    HEAD_DIMS, block_size a multiple of 16; block_tables: [seqs, >= blocks used] int32 (row
    stride free); context_lens: [seqs] int32. splits > 1: per-split fp32 partials (allocated
    here) merged by the pair's last block. arch: the kernel built for this older arch (as PTX;
    tests run sm_80's build on newer GPUs); config: (warps, stages) instead of the default
    (benchmarks/attention.py times variants).
    """
    seqs, heads, d = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if not supported(q.dtype, d, heads, kv_heads, block_size):
        raise ValueError(
            f"paged_decode: unsupported {q.dtype}, head_dim {d}, heads {heads}/{kv_heads}, block_size {block_size}"
        )
    if (
        k_cache.dtype != q.dtype
        or v_cache.shape != k_cache.shape
        or v_cache.dtype != q.dtype
        or k_cache.shape[3] != d
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        raise ValueError("paged_decode: caches must be contiguous [blocks, block_size, kv_heads, D] in q's dtype")
    if q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError("q and out: heads contiguous within a row")
    if (
        (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16
        or q.stride(0) % 8
        or out.data_ptr() % 8
        or out.stride(0) % 4
    ):
        raise ValueError("paged_decode: q and the caches 16-byte aligned (q's rows too), out 8-byte aligned")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise TypeError("block_tables and context_lens must be int32, table rows unit-stride")
    if not 1 <= splits <= MAX_SPLITS or splits > 1 and seqs * kv_heads > COUNTERS:
        raise ValueError(f"paged_decode: {splits} splits for {seqs} x {kv_heads} (sequence, KV head) pairs")
    if seqs == 0:
        return out
    index = _index(q.device)
    arch, warps, n_stages, smem = _config(d, index, arch, config)
    func = _function(kernel_name(q.dtype, d, arch, warps, n_stages), index, arch, smem)
    part_acc = part_ml = counters = None
    if splits > 1:
        part_acc = torch.empty(seqs * heads * splits * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(seqs * heads * splits * 2, dtype=torch.float32, device=q.device)
        counters = _counters(index)
    args = _DecodeArgs(
        q=q.data_ptr(),
        out=out.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        block_tables=block_tables.data_ptr(),
        context_lens=context_lens.data_ptr(),
        part_acc=None if part_acc is None else part_acc.data_ptr(),
        part_ml=None if part_ml is None else part_ml.data_ptr(),
        counters=None if counters is None else counters.data_ptr(),
        q_stride=q.stride(0),
        out_stride=out.stride(0),
        table_stride=block_tables.stride(0),
        heads=heads,
        kv_heads=kv_heads,
        group=heads // kv_heads,
        block_size=block_size,
        splits=splits,
        scale=scale,
        window=window or 0,
        softcap=softcap or 0.0,
    )
    from .launch import launch

    launch(func, seqs, 32 * warps, args, q.device, smem=smem, grid_y=kv_heads, grid_z=splits)
    return out
