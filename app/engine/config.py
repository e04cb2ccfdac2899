"""Engine configuration (one frozen dataclass; pydantic lives at the YAML/HTTP boundary)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # batch limit: requests running at once
    max_tokens_per_step: int = 2048  # prefill + decode tokens in one forward pass
    num_kv_blocks: int | None = 512  # None: auto, what fits on the GPU (app/engine/kv_sizing.py); CUDA only
    block_size: int = 16
    max_loras: int = 8  # adapter slots resident at once
    lora_memory_bytes: int | None = None  # if set, sizes the slots instead of max_loras
    max_lora_rank: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured at start-up (False: eager, for debugging)
    mixed_graph_tokens: int = 0  # CUDA: steps with prefills of up to this many tokens replay graph pieces (0: eager)
    tensor_parallel_size: int = 1  # GPUs (shard workers) one replica's model spans
    prefix_caching: bool = True  # share full KV blocks of equal (weights, token prefix) across requests
    prefix_cache_max_blocks: int | None = None  # unreferenced cached blocks kept at most (None: any free block)
    quantization: str | None = None  # "fp8": fp8 base projections (app/model/quantization.py)
    # a preempted request goes back to the front of the waiting queue, recomputed when re-admitted (a lone
    # replica: nowhere to move it); off: it leaves its stream with a Migrate, to be resumed elsewhere
    requeue_preempted: bool = False
    engine_process: bool = False  # the engine loop in a child process of its replica (app/engine/process_engine.py)
    gpu_memory_utilization: float = 0.9  # auto KV: the share of the GPU's memory the replica may fill
    # every op reduces in a batch-independent order (app/engine/determinism.py); off: the libraries' choices
    deterministic: bool = False

    def __post_init__(self):
        if torch.device(self.device).type == "cuda" and self.dtype not in (torch.float16, torch.bfloat16):
            # the SGMV, attention and small-op kernels are compiled for half types only
            raise ValueError(f"dtype {self.dtype} is not served on CUDA: use torch.float16 or torch.bfloat16")
        if self.num_kv_blocks is None and torch.device(self.device).type != "cuda":
            raise ValueError("num_kv_blocks auto sizes the KV cache from a GPU's free memory: on the CPU give a number")
        if self.num_kv_blocks is None and self.tensor_parallel_size > 1:  # the probe measures one GPU only
            raise ValueError(
                "num_kv_blocks auto is not available with tensor_parallel_size > 1: give a number "
                "(docs/deploy.md, the KV memory formula)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        why = self._determinism_refusal()
        if why is not None:
            raise ValueError(why)

    def _determinism_refusal(self) -> str | None:
        """Why `deterministic` cannot be honoured with the rest of this config (None: it can). Each
        named feature runs a path with no fixed order yet (the model's own limits: determinism.py)."""
        if not self.deterministic:
            return None
        if self.quantization is not None:
            return f"deterministic: not with quantization {self.quantization!r} (its GEMM has no fixed-order path)"
        if self.tensor_parallel_size > 1:
            return (
                "deterministic: not with tensor_parallel_size > 1 (the all-reduce's order depends on the message size)"
            )
        if self.mixed_graph_tokens > 0:
            return "deterministic: not with mixed_graph_tokens > 0 (the graph pieces run the library's attention)"
        return None
