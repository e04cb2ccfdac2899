"""vLLM's multi-LoRA Triton kernels (lora_shrink + lora_expand, vLLM 0.33) as the peer of the
SGMV benchmark, run in the same process and timed by the same method as ours.

The GPU machine has no vLLM: benchmarks/make-vllm-bundle.sh packs its Python sources, and
`source .vllm-peer/install.sh` there unpacks them and sets VLLM_PEER_SITE. vLLM's compiled
extension is not carried: it is built for torch 2.14 (the device has 2.11) and the LoRA ops
are pure Triton. vLLM's CUDA platform class imports it only to register other custom ops, so
an empty module stands in for it; that class is what the LoRA ops ask for the device's
capability (on sm_90 vLLM runs its expand single-staged on fp32 input, a ptxas workaround).
"""
import os
import sys
import types

import torch


def load(site=None):
    """Import vLLM's LoRA ops from `site` (default $VLLM_PEER_SITE); fails unless vLLM sees CUDA.
    vLLM finds CUDA through NVML; where a sandbox hides NVML but torch sees the GPU, vLLM's own
    platform class for CUDA is set (it falls back to torch's queries without NVML)."""
    sys.path.insert(0, site or os.environ["VLLM_PEER_SITE"])
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm
    import vllm.platforms

    if not vllm.platforms.current_platform.is_cuda() and torch.cuda.is_available():
        from vllm.platforms.cuda import CudaPlatform

        vllm.platforms.current_platform = CudaPlatform()
    current_platform = vllm.platforms.current_platform
    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM detected {type(current_platform).__name__}, not CUDA: its kernels would "
                           "not run as they do in vLLM")
    from vllm.lora.ops import triton_ops  # binds the platform at import: after it is known

    return triton_ops, vllm.__version__


class VllmPool:
    """An adapter pool in vLLM's layout: A as ours [slots, rank, h], B transposed [slots, h, rank]."""

    def __init__(self, triton_ops, A, B):
        self.ops, self.A, self.B = triton_ops, A, B.transpose(1, 2).contiguous()

    def add_on(self, case, specialize=True):
        """vLLM's add-on for `case` (rows → pool slots as case.row_slots), one scale for all rows
        (vLLM's form). specialize: the grid spans the active adapters only, vLLM's faster
        setting; else all slots + 1."""
        meta = self.ops.LoRAKernelMeta.make(max_loras=self.A.shape[0], max_num_tokens=case.batch, device="cuda")
        meta.prepare_tensors(case.row_slots.to(torch.int32))
        args = meta.meta_args(case.batch, specialize)
        v = torch.empty(1, case.batch, self.A.shape[1], device="cuda")  # vLLM's buffer: fp32

        def run():
            self.ops.lora_shrink(case.x, [self.A], v, *args, 1.0)
            self.ops.lora_expand(v, [self.B], case.y, *args, offset_start=0, add_inputs=True)
        return run


def rel_err(case, run):
    """Relative error of vLLM's add-on against fp32 x·A·B per row (scale 1); y is left as it was."""
    y0 = case.y.clone()
    run()
    got = case.y.float() - y0.float()
    case.y.copy_(y0)
    A, B = case.A[case.row_slots].float(), case.B[case.row_slots].float()  # [rows, rank, h] each
    ref = torch.bmm(torch.bmm(case.x.float()[:, None, :], A.transpose(1, 2)), B)[:, 0]
    return float((got - ref).norm() / ref.norm())
