"""fp32 torch references for every op in `ops/`.

They define the semantics the CUDA kernels are tested against and are the
CPU path of the model. Adapter pools use one layout everywhere:

    A: [slots, max_rank, h_in]   (PEFT ``lora_A.weight`` rows, zero beyond rank)
    B: [slots, max_rank, h_out]  (PEFT ``lora_B.weight`` transposed)
    ranks: [slots] int32, scales: [slots] float32

A batch is cut into segments: rows ``indptr[i]:indptr[i+1]`` use adapter slot
``slot_ids[i]``; slot −1 means "no adapter" and the segment is skipped.
"""

import torch


def _segments(indptr: torch.Tensor, slot_ids: torch.Tensor):
    bounds = indptr.tolist()
    for i, slot in enumerate(slot_ids.tolist()):
        if slot >= 0 and bounds[i + 1] > bounds[i]:
            yield bounds[i], bounds[i + 1], slot


def sgmv_shrink_ref(v, x, A, indptr, slot_ids, ranks):
    """v[s_i:s_{i+1}, :r_i] = x[s_i:s_{i+1}] @ A[slot_i, :r_i].T

    v: [tokens, max_rank] written in place (only rows of segments with an
    adapter, only columns < rank); x: [tokens, h_in]; A: [slots, max_rank, h_in].
    """
    r_of = ranks.tolist()
    for lo, hi, slot in _segments(indptr, slot_ids):
        r = r_of[slot]
        out = x[lo:hi].float() @ A[slot, :r].float().T
        v[lo:hi, :r] = out.to(v.dtype)
    return v


def sgmv_expand_ref(y, v, B, indptr, slot_ids, ranks, scales, y_offset=0):
    """y[s_i:s_{i+1}, off:off+h_out] += scale_i * v[s_i:s_{i+1}, :r_i] @ B[slot_i, :r_i]

    y: [tokens, >= off + h_out] updated in place; v: [tokens, max_rank];
    B: [slots, max_rank, h_out]. ``y_offset`` addresses one slice of a fused
    projection output (q|k|v or gate|up).
    """
    r_of, s_of = ranks.tolist(), scales.tolist()
    h_out = B.shape[-1]
    for lo, hi, slot in _segments(indptr, slot_ids):
        r = r_of[slot]
        delta = (v[lo:hi, :r].float() @ B[slot, :r].float()) * s_of[slot]
        cols = slice(y_offset, y_offset + h_out)
        y[lo:hi, cols] = (y[lo:hi, cols].float() + delta).to(y.dtype)
    return y


def lora_ref(y, x, A, B, indptr, slot_ids, ranks, scales, y_offset=0):
    """y[seg, off:off+h_out] += scale * x[seg] @ A[slot].T @ B[slot] for every segment.

    The whole LoRA add-on (shrink then expand) in fp32; y updated in place.
    """
    v = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink_ref(v, x, A, indptr, slot_ids, ranks)
    return sgmv_expand_ref(y, v, B, indptr, slot_ids, ranks, scales, y_offset)
