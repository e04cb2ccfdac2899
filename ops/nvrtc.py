"""Run-time compilation of `ops/kernels/*.cu` with NVRTC, cubins cached on disk.

A kernel is named by its source file and a template instantiation, e.g.
``("sgmv.cu", "sgmv_kernel<__half, 16, 1, 8, 1, float>")``. It is compiled
once per process for the device's arch and the cubin is cached under
``$LORAPLEX_CACHE/nvrtc`` (``LORAPLEX_CACHE`` defaults to ``~/.cache/loraplex``, the node's
cache of checkpoints too: app/model/node_cache.py), keyed by the sha256
of every kernel source and header, the options, the arch and the NVRTC version.
NVRTC needs no GPU, so CI compiles every kernel for sm_80 and sm_90. A kernel
can also be built for an older arch than the device's (``load_function(...,
arch=80)`` on an H200): as PTX, which the driver compiles for the device, so
the older arch's code path runs on this GPU.
"""

import functools
import glob
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

from cuda.bindings import driver, nvrtc

KERNEL_DIR = pathlib.Path(__file__).with_name("kernels")
_NEEDED = ("cuda_fp16.h", "cuda_bf16.h")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries its log."""


def _ok(result, what):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def _candidate_include_dirs():
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            yield os.path.join(os.environ[var], "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include")
    yield "/usr/local/cuda/include"
    # pip wheels: nvidia/cuda_runtime/include (CUDA 12) or nvidia/cu13/include (CUDA 13)
    for root in sys.path:
        yield from sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")))


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h / cuda_bf16.h (toolkit first, then pip wheels)."""
    found = []
    for d in map(os.path.normpath, _candidate_include_dirs()):
        if d not in found and all(os.path.isfile(os.path.join(d, h)) for h in _NEEDED):
            found.append(d)
    if not found:
        raise CompileError(
            "no CUDA include directory with cuda_fp16.h and cuda_bf16.h: set CUDA_HOME, "
            "or install the CUDA toolkit or the nvidia-cuda-runtime wheel"
        )
    return tuple(found[:1])


@functools.cache
def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def options(arch: int, extra: tuple[str, ...], ptx: bool = False) -> list[bytes]:
    """NVRTC's options for sm_`arch` (compute_`arch` with `ptx`): C++17, the kernels' include paths, `extra`."""
    target = f"compute_{arch}" if ptx else f"sm_{arch}"
    opts = [f"--gpu-architecture={target}", "-std=c++17", f"-I{KERNEL_DIR}"]
    opts += [f"-I{d}" for d in include_dirs()]
    return [o.encode() for o in (*opts, *extra)]


def _cache_dir() -> pathlib.Path:
    """The cubins' folder: ``nvrtc/`` under the node's cache (the same folder app/model/node_cache.py reads)."""
    root = os.environ.get("LORAPLEX_CACHE") or os.path.expanduser("~/.cache/loraplex")
    return pathlib.Path(root) / "nvrtc"


def _write_atomic(path: pathlib.Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # concurrent compilers of one key write the same bytes


def compile_uncached(source: str, name_expr: str, opts: list[bytes], ptx: bool = False) -> tuple[bytes, str, str]:
    """(cubin, or PTX for a compute_XX target; lowered name; NVRTC's log, with ptxas' resource
    report when `opts` hold --ptxas-options=-v). No disk cache: compile_kernel adds it."""
    text = (KERNEL_DIR / source).read_bytes()
    prog = _ok(nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], []), "create")
    try:
        _ok(nvrtc.nvrtcAddNameExpression(prog, name_expr.encode()), "name expression")
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        _ok(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        log = log.decode(errors="replace").rstrip("\0 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{source} {name_expr}:\n{log}")
        lowered = _ok(nvrtc.nvrtcGetLoweredName(prog, name_expr.encode()), "lowered name")
        get_size, get = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        if ptx:
            get_size, get = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
        image = b" " * _ok(get_size(prog), "image size")
        _ok(get(prog, image), "image")
        return image, lowered.decode(), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@functools.cache
def compile_kernel(
    source: str, name_expr: str, arch: int, extra: tuple[str, ...] = (), ptx: bool = False
) -> tuple[bytes, str]:
    """(cubin, lowered symbol name) for `name_expr` in kernels/`source`, sm_`arch`; with
    `ptx`, PTX for compute_`arch` instead of the cubin."""
    opts = options(arch, extra, ptx)
    version = _ok(nvrtc.nvrtcVersion(), "version")
    key = hashlib.sha256(repr((_sources_digest(), source, name_expr, opts, tuple(version))).encode()).hexdigest()[:32]
    image_path = _cache_dir() / f"{key}.{'ptx' if ptx else 'cubin'}"
    name_path = _cache_dir() / f"{key}.sym"
    if image_path.is_file() and name_path.is_file():
        return image_path.read_bytes(), name_path.read_text()
    image, lowered, _ = compile_uncached(source, name_expr, opts, ptx)
    _write_atomic(image_path, image)
    _write_atomic(name_path, lowered.encode())
    return image, lowered


def _drv(result, what):
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {driver.cuGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


@functools.cache
def load_function(
    source: str, name_expr: str, device: int, extra: tuple[str, ...] = (), arch: int | None = None
) -> driver.CUfunction:
    """The kernel as a CUfunction in `device`'s primary context (torch's context);
    `extra`: more NVRTC options (e.g. a -D for an instrumented build); `arch`: build it for
    this older arch than the device's (as PTX, compiled for the device by the driver)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    own = 10 * major + minor
    target = own if arch is None else arch
    if target > own:
        raise ValueError(f"sm_{target} code cannot run on this sm_{own} device")
    image, lowered = compile_kernel(source, name_expr, target, extra, ptx=target != own)
    ctx = _drv(driver.cuDevicePrimaryCtxRetain(_drv(driver.cuDeviceGet(device), "device")), "context")
    _drv(driver.cuCtxPushCurrent(ctx), "push context")
    try:
        module = _drv(driver.cuModuleLoadData(image), f"load {name_expr}")
        func = _drv(driver.cuModuleGetFunction(module, lowered.encode()), f"get {lowered}")
        if major >= 9:  # clusters of 16 blocks need this opt-in; harmless for the rest
            allow = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            driver.cuFuncSetAttribute(func, allow, 1)
        return func
    finally:
        _drv(driver.cuCtxPopCurrent(), "pop context")


def allow_dynamic_smem(func: driver.CUfunction, device: int, smem: int, what: str) -> None:
    """Let `func` take `smem` bytes of dynamic shared memory per block (over 48 KB needs this opt-in)."""
    ctx = _drv(driver.cuDevicePrimaryCtxRetain(_drv(driver.cuDeviceGet(device), "device")), "context")
    _drv(driver.cuCtxPushCurrent(ctx), "push context")
    try:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _drv(driver.cuFuncSetAttribute(func, attr, smem), f"{what}: {smem} bytes of shared memory")
    finally:
        _drv(driver.cuCtxPopCurrent(), "pop context")
