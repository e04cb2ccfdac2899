"""The LoRA add-on, dispatched by device: SGMV CUDA kernels on GPU, the fp32 reference elsewhere."""
from ops.reference import lora_ref


def add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=0):
    """y[seg, off:off+h_out] += scale[slot] * x[seg] @ A[slot].T @ B[slot] per segment (slot −1 skips).

    y: [tokens, >= off + h_out] in place; x: [tokens, h_in]; A: [slots, max_rank, h_in];
    B: [slots, max_rank, h_out]; indptr: [segments + 1] int32; slot_ids: [segments] int32.
    """
    if x.is_cuda:
        from ops.sgmv import add_lora as sgmv_add_lora

        return sgmv_add_lora(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=y_offset)
    return lora_ref(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset)
