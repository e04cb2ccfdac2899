"""Launch of kernels/sampling.cu: the random draw of a step's sampled rows in one kernel.

app/engine/sampler.py's torch ops (temperature, top-k, top-p by a sort, inverse-CDF draw) are the
reference and the CPU path; on CUDA they cost ~20 launches and a segmented sort of the whole
vocabulary per step, this one launch and no sort. Nothing here allocates, reads device memory on
the host, or synchronizes, so the draw queues behind a graph replay or a step launched ahead.
"""

import ctypes

import torch

KERNEL = "sample_rows_kernel"


class _Args(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("z", "greedy", "inv_t", "k", "p", "u", "tokens")]
    _fields_ += [("z_stride", ctypes.c_longlong), ("vocab", ctypes.c_int)]


def usable(z: torch.Tensor) -> bool:
    return z.is_cuda and z.dtype == torch.float32 and z.dim() == 2 and z.stride(1) == 1


def sample_rows(
    z: torch.Tensor,
    greedy: torch.Tensor,
    inv_t: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    u: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """tokens[i] = the draw of row i, for every row that is not greedy[i]: the first token in
    vocabulary order whose cumulative exp(s) exceeds u[i] · Σ exp(s), over the tokens with
    s = (z[i] − max z[i]) · inv_t[i] at least the row's floor (the k[i]-th largest s when
    0 < k[i]; then the smallest s whose larger values hold < p[i] of that kept mass when p[i] < 1).
    Greedy rows keep what tokens holds (their argmax).

    z: [n, vocab] float32, unit-stride rows; greedy: [n] bool; inv_t: [n] float32; k: [n] int64
    (0: off, else < vocab); p: [n] float64 (1: off); u: [n] float64 in (0, 1); tokens: [n] int64,
    updated in place. All contiguous on z's device.
    """
    n, vocab = z.shape
    if n == 0:
        return
    if not usable(z):
        raise ValueError("sample_rows: z must be a CUDA float32 [n, vocab] tensor with unit-stride rows")
    want = ((greedy, torch.bool), (inv_t, torch.float32), (k, torch.int64), (p, torch.float64), (u, torch.float64))
    for t, dtype in (*want, (tokens, torch.int64)):
        if t.dtype != dtype or t.shape != (n,) or not t.is_contiguous() or t.device != z.device:
            raise ValueError(f"sample_rows: every row parameter must be a contiguous [{n}] {dtype} on {z.device}")
    args = _Args(
        z=z.data_ptr(),
        greedy=greedy.data_ptr(),
        inv_t=inv_t.data_ptr(),
        k=k.data_ptr(),
        p=p.data_ptr(),
        u=u.data_ptr(),
        tokens=tokens.data_ptr(),
        z_stride=z.stride(0),
        vocab=vocab,
    )
    from . import launch  # not at import: CPU-only processes never load NVRTC

    launch.launch(_function(z.device), n, 1024, args, z.device)


def _function(device):
    from . import nvrtc

    device = torch.device(device)
    return nvrtc.load_function(
        "sampling.cu", KERNEL, device.index if device.index is not None else torch.cuda.current_device()
    )


def warm_up(device) -> None:
    """Compile and load the kernel now: a first-use compile would stall a step mid-serving."""
    _function(device)
