"""What the timing method gives a kernel that only reads: an achievable floor (device only).

The same number of bytes as an add-on must move, read contiguously by a kernel that
does nothing else (no index lookup, no dependent second phase), timed exactly as
benchmarks/sgmv.py times the add-on: a one-kernel CUDA graph replayed behind the
256 MiB L2 flush. The fastest of torch.sum and a Triton block-sum at three block
sizes is reported, so the floor is not one library's weakness.
"""

import functools

import torch
import triton
import triton.language as tl

BLOCKS = (4096, 8192, 16384)  # elements per Triton program


@triton.jit
def _block_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(v.to(tl.float32), axis=0))


class ReadFloor:
    """read_us(nbytes): µs of the fastest read-only kernel over nbytes (fp16), cached per size."""

    def __init__(self, max_bytes, time_graph, flush):
        self.buf = torch.randn(max_bytes // 2, device="cuda", dtype=torch.float16)
        self.time_graph, self.flush = time_graph, flush

    @functools.cache
    def read_us(self, nbytes):
        n = max(1, nbytes // 2)
        x = self.buf[:n]
        total = torch.empty((), device="cuda")
        candidates = [lambda: torch.sum(x, dim=0, dtype=torch.float32, out=total)]
        candidates[0]()
        for block in BLOCKS:
            out = torch.empty(triton.cdiv(n, block), device="cuda")
            candidates.append(functools.partial(_block_sums[(out.numel(),)], x, out, n, BLOCK=block))
            candidates[-1]()  # a wrong kernel would make a meaningless floor
            assert torch.allclose(out.sum(), total, rtol=1e-3, atol=1.0), (block, float(out.sum()), float(total))
        return min(self.time_graph(fn, self.flush) for fn in candidates)
