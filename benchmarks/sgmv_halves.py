"""The LoRA add-on as two launches, shrink then expand through an fp32 v in memory: the unfused
baseline benchmarks/sgmv.py times ops.sgmv.add_lora against (column ours_2launch_us), and
tests/gpu/test_sgmv_gpu.py checks. The engine runs only the fused add_lora. CUDA tensors only;
layouts and requirements as in ops/sgmv.py.
"""

from ops.sgmv import check_operands
from ops.sgmv_plan import launch
from ops.sgmv_shapes import EXPAND, SHRINK


def sgmv_shrink(v, x, A, indptr, slot_ids, ranks):
    """v[s_i:s_{i+1}, :r_i] = x[s_i:s_{i+1}] @ A[slot_i, :r_i].T for every segment i with slot_i >= 0.

    v: [tokens, >= max_rank] float32, written in place only in the
    rows of segments with an adapter and columns < that adapter's rank.
    x: [tokens, h_in] fp16/bf16; A: [slots, max_rank, h_in]. Returns v.
    Split-K over h_in across a cluster of 8 blocks (sm_90).
    """
    check_operands(x, A, x, v, (indptr, slot_ids, ranks))
    launch(SHRINK, x.shape[0], x=x, v=v, A=A, indptr=indptr, slot_ids=slot_ids, ranks=ranks)
    return v


def sgmv_expand(y, v, B, indptr, slot_ids, ranks, scales, y_offset=0):
    """y[s_i:s_{i+1}, off:off+h_out] += scale_i * v[s_i:s_{i+1}, :r_i] @ B[slot_i, :r_i] (slot_i >= 0).

    y: [tokens, >= y_offset + h_out] fp16/bf16, updated in place (row stride
    y.stride(0), so y may be a fused q|k|v or gate|up output); v: [tokens,
    >= max_rank] float32, read up to each adapter's rank;
    B: [slots, max_rank, h_out]. Accumulates in fp32, rounds once. Returns y.
    """
    check_operands(y, B, y, v, (indptr, slot_ids, ranks, scales), y_offset)
    launch(
        EXPAND,
        y.shape[0],
        y=y,
        v=v,
        B=B,
        indptr=indptr,
        slot_ids=slot_ids,
        ranks=ranks,
        scales=scales,
        y_offset=y_offset,
    )
    return y
