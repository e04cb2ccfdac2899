"""Why an engine could not start, in one line: the cause and the fix (docs/deploy.md, troubleshooting).

A replica that cannot start because of its configuration or hardware fails with a StartupError
whose message is that line; the replica raises it without the chain of exceptions below it, so
Serve's status and log show the cause first and once. Checked before anything is put on the GPU:
the GPU's architecture (the kernels need sm_80 or newer) and whether the checkpoint's tensors have
the shapes its config.json gives. Each later stage that fills the GPU (weights, adapter slots, KV
cache and CUDA graphs) turns an out-of-memory error into the line naming that stage's fix.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch

GB = 2**30
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores and the kernels' async copies: A100 (sm_80) and newer


class StartupError(RuntimeError):
    """An engine that cannot start as configured; the message is one line: the cause, then the fix."""


def describe_device(device: str) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3, sm_90, 79.1 GB, 61.0 GB free)'; the device itself when not CUDA."""
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return str(d)
    index = d.index if d.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    free, total = torch.cuda.mem_get_info(index)
    name = torch.cuda.get_device_name(index)
    return f"cuda:{index} ({name}, sm_{major}{minor}, {total / GB:.1f} GB, {free / GB:.1f} GB free)"


def check_gpu(device: str, capability: tuple[int, int] | None = None) -> None:
    """Refuse a GPU older than sm_80 before a kernel is compiled for it (NVRTC would fail obscurely)."""
    if torch.device(device).type != "cuda":
        return
    if capability is None:
        if not torch.cuda.is_available():
            raise StartupError(
                f"device {device} asked for, but torch sees no CUDA device: install a CUDA build of torch"
            )
        capability = torch.cuda.get_device_capability(torch.device(device))
    if tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        raise StartupError(
            f"GPU sm_{major}{minor} is not supported: loraplex's kernels need sm_80 or newer "
            "(A100 sm_80, A10/L4/L40/RTX 30-40 sm_86/sm_89, H100/H200 sm_90); use such a GPU or device: cpu"
        )


def _expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The tensors the loader (app/model/weights.py) reads and the shapes cfg implies."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        if cfg.traits.fused_checkpoint:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h)})
            shapes.update({p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (i, h)})
            shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def _checkpoint_shapes(ckpt: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape from the safetensors headers (no data read); None: not safetensors."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return None
    shapes = {}
    for name in files:
        with safe_open(str(ckpt / name), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def check_checkpoint(ckpt: Path, cfg) -> None:
    """Refuse a checkpoint whose tensors are not what its config.json describes, naming the first one."""
    found = _checkpoint_shapes(Path(ckpt))
    if found is None:
        return  # the loader reports what it cannot open
    for key, shape in _expected_shapes(cfg).items():
        if key not in found:
            raise StartupError(
                f"checkpoint {Path(ckpt).name} does not match its config.json: it has no tensor {key} "
                f"(config: {cfg.num_layers} layers, family {cfg.family}); use the config.json that came with the weights"
            )
        if found[key] != shape:
            raise StartupError(
                f"checkpoint {Path(ckpt).name} does not match its config.json: {key} is {list(found[key])}, the "
                f"config implies {list(shape)}; use the config.json that came with the weights"
            )


_FIXES = {
    "weights": "use a GPU with more memory, or shard the model over GPUs with tensor_parallel_size",
    "adapters": "lower max_loras, max_lora_rank or lora_memory_gb",
    "kv": "lower num_kv_blocks (or set it to auto), max_batch_size or max_tokens_per_step",
}
_STAGES = {
    "weights": "loading the weights",
    "adapters": "allocating the adapter slots",
    "kv": "allocating the KV cache and capturing the CUDA graphs",
}


@contextmanager
def stage(name: str, device: str):
    """Turn this stage's out-of-memory or kernel-compile failure into a one-line StartupError."""
    from ops.nvrtc import CompileError

    try:
        yield
    except torch.OutOfMemoryError as exc:
        asked = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", str(exc))
        detail = f" (tried to allocate {asked.group(1)})" if asked else ""
        raise StartupError(
            f"out of GPU memory {_STAGES[name]} on {describe_device(device)}{detail}: {_FIXES[name]}"
        ) from None
    except CompileError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StartupError(
            f"NVRTC could not compile a kernel for {describe_device(device)}: {first}; the kernels need sm_80 or "
            "newer and the CUDA headers (set CUDA_HOME or install the nvidia-cuda-runtime wheel)"
        ) from None


_REMOTE = re.compile(r"^app\.engine\.\w+\.(?:StartupError|KvCacheError): (.+)$", re.MULTILINE)


def startup_cause(exc: BaseException) -> str | None:
    """The one-line cause if ``exc`` is a StartupError, or carries one's traceback as text (an engine
    built in a child process reports its failure so); None for anything else."""
    if isinstance(exc, StartupError):
        return str(exc)
    found = _REMOTE.findall(str(exc))
    return found[-1] if found else None
