"""Engine configuration (one frozen dataclass; pydantic lives at the YAML/HTTP boundary)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # batch limit: requests running at once
    max_tokens_per_step: int = 2048  # prefill + decode tokens in one forward pass
    num_kv_blocks: int = 512
    block_size: int = 16
    max_loras: int = 8  # adapter slots resident at once
    lora_memory_bytes: int | None = None  # if set, sizes the slots instead of max_loras
    max_lora_rank: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured at start-up (False: eager, for debugging)
    tensor_parallel_size: int = 1  # GPUs (shard workers) one replica's model spans
    prefix_caching: bool = True  # share full KV blocks of equal (weights, token prefix) across requests
    prefix_cache_max_blocks: int | None = None  # unreferenced cached blocks kept at most (None: any free block)

    def __post_init__(self):
        if torch.device(self.device).type == "cuda" and self.dtype not in (torch.float16, torch.bfloat16):
            # the SGMV, attention and small-op kernels are compiled for half types only
            raise ValueError(f"dtype {self.dtype} is not served on CUDA: use torch.float16 or torch.bfloat16")
