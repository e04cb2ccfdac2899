"""What one kernel launch costs under the benchmark's timing method (device only).

    python benchmarks/launch_probe.py

Empty kernels, each captured alone in a CUDA graph and replayed behind the 256 MiB L2
write flush (benchmarks/sgmv.py's time_graph), two rounds: torch's own empty kernel (the
benchmark's null graph), then NVRTC kernels launched through ops/launch.py with no
parameters, with a 136-byte parameter block like SgmvArgs (read once, so its constant
bank is fetched), as a 16-block cluster, and with 16 KiB of shared memory. Tells which
part of the fixed cost in every add-on figure comes with our launch's shape.
"""
import ctypes
import pathlib
import sys
import tempfile

import torch
from cuda.bindings import driver

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.method import time_graph  # noqa: E402
from benchmarks.sgmv_variants import kernel_sources  # noqa: E402
from ops import launch, nvrtc  # noqa: E402

SOURCE = r"""
struct Big { long long f[17]; };
__global__ void empty_noargs() {}
__global__ void empty_big(const Big a) { if (a.f[0] == 12345) asm volatile("trap;"); }
__global__ void __cluster_dims__(16, 1, 1) empty_cluster(const Big a) { if (a.f[0] == 12345) asm volatile("trap;"); }
__global__ void empty_big_smem(const Big a) {
  __shared__ int s[4096];
  s[threadIdx.x] = a.f[1];
  __syncthreads();
  if (s[(threadIdx.x + 1) % 128] == 12345) asm volatile("trap;");
}
"""


class Big(ctypes.Structure):
    _fields_ = [("f", ctypes.c_longlong * 17)]


def no_params(func, grid, block):
    def go():
        stream = torch.cuda.current_stream().cuda_stream
        (err,) = driver.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, stream, 0, 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
    return go


def main():
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "empty.cu").write_text(SOURCE)
        with kernel_sources(tmp):
            f = {n: nvrtc.load_function("empty.cu", n, 0)
                 for n in ("empty_noargs", "empty_big", "empty_cluster", "empty_big_smem")}
    flush = torch.empty(2**28 // 4, device="cuda")
    dev, big = torch.device("cuda", 0), Big()
    rows = [("torch empty kernel (null graph)", lambda: torch.cuda._sleep(0)),
            ("no params 1x1", no_params(f["empty_noargs"], 1, 1)),
            ("no params 256x128", no_params(f["empty_noargs"], 256, 128)),
            ("136 B params 1x1", lambda: launch.launch(f["empty_big"], 1, 1, big, dev)),
            ("136 B params 256x128", lambda: launch.launch(f["empty_big"], 256, 128, big, dev)),
            ("136 B params, cluster 16, 256x128", lambda: launch.launch(f["empty_cluster"], 256, 128, big, dev)),
            ("136 B params, 16 KiB smem, 256x128", lambda: launch.launch(f["empty_big_smem"], 256, 128, big, dev))]
    print(torch.cuda.get_device_name(0))
    for rnd in range(2):
        for name, fn in rows:
            print(f"round {rnd}  {name:36s} {time_graph(fn, flush):6.2f} µs", flush=True)


if __name__ == "__main__":
    main()
