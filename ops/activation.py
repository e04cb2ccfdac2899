"""SwiGLU and GeGLU (CUDA fp16/bf16: one kernel each, `ops.small_ops`)."""

import torch
import torch.nn.functional as F

from . import small_ops


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [tokens, 2 * inter] → [tokens, inter]."""
    if small_ops.usable(gate_up):
        return small_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] (Gemma's GeGLU): [tokens, 2 * inter] → [tokens, inter]."""
    if small_ops.usable(gate_up):
        return small_ops.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
