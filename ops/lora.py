"""The LoRA add-on, dispatched by device: SGMV CUDA kernels on GPU, the fp32 reference elsewhere."""
import torch

from ops.reference import lora_ref


def prepare(dtype, max_rank: int, device) -> None:
    """Ready the kernels add_lora will run for a pool like this (CUDA: compiled and loaded now)."""
    if torch.device(device).type == "cuda":
        from ops.sgmv import warm_up

        warm_up(dtype, max_rank, device)


def add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=0, host_segments=None):
    """y[seg, off:off+h_out] += scale[slot] * x[seg] @ A[slot].T @ B[slot] per segment (slot −1 skips).

    y: [tokens, >= off + h_out] in place; x: [tokens, h_in]; A: [slots, max_rank, h_in];
    B: [slots, max_rank, h_out]; indptr: [segments + 1] int32; slot_ids: [segments] int32.
    host_segments: the same segments as host tuples (lo, hi, slot, rank, scale); on the CPU
    they spare the per-call device→host reads of the reference, computing in x's dtype.
    """
    if x.is_cuda:
        from ops.sgmv import add_lora as sgmv_add_lora

        return sgmv_add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=y_offset)
    if host_segments is None:
        return lora_ref(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset)
    cols = slice(y_offset, y_offset + B.shape[-1])
    for lo, hi, slot, r, scale in host_segments:
        y[lo:hi, cols] += (x[lo:hi] @ A[slot, :r].T) @ B[slot, :r] * scale
    return y
