"""Engines that cannot start, for the Serve tests of start-up failures (importable by Ray's workers)."""

import torch

from app.engine.startup import stage


def engine_out_of_memory(settings, attempts: str):
    """An engine_factory that fails as an oversized KV cache does on a GPU (and counts its calls in ``attempts``)."""
    with open(attempts, "a") as f:
        f.write("attempt\n")
    with stage("kv", "cpu"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total capacity")
