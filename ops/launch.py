"""Launch NVRTC-compiled kernels through the driver API on torch's current stream.

Kernels take their arguments as one C struct passed by value (``const Args a``);
the host mirrors it as a ``ctypes.Structure``, which ctypes lays out exactly as
the C compiler does, so ``cuLaunchKernel`` needs a single parameter pointer.
Nothing here allocates device memory or waits for the device, so a launch can
be captured in a CUDA graph like any torch kernel.
"""

import ctypes

import torch
from cuda.bindings import driver

_SUCCESS = driver.CUresult.CUDA_SUCCESS


def launch(
    func: driver.CUfunction,
    grid: int,
    block: int,
    args: ctypes.Structure,
    device: torch.device,
    smem: int = 0,
    grid_y: int = 1,
    grid_z: int = 1,
):
    """Run `func` on a grid of `grid` x `grid_y` x `grid_z` blocks of `block` threads with `args` (and
    `smem` bytes of dynamic shared memory per block) on the current stream of `device`."""
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    stream = torch.cuda.current_stream(device).cuda_stream
    (err,) = driver.cuLaunchKernel(func, grid, grid_y, grid_z, block, 1, 1, smem, stream, ctypes.addressof(params), 0)
    if err != _SUCCESS:
        raise RuntimeError(f"cuLaunchKernel: {driver.cuGetErrorString(err)[1].decode()}")


def max_active_clusters(func: driver.CUfunction, cluster: int, block: int, smem: int = 0) -> int:
    """How many thread-block clusters of `func` (its compiled cluster width `cluster`, blocks of
    `block` threads) the current device holds at once."""
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes, cfg.numAttrs = smem, 0
    err, n = driver.cuOccupancyMaxActiveClusters(func, cfg)
    if err != _SUCCESS:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: {driver.cuGetErrorString(err)[1].decode()}")
    return n
