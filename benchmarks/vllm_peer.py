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
        raise RuntimeError(
            f"vLLM detected {type(current_platform).__name__}, not CUDA: its kernels would not run as they do in vLLM"
        )
    from vllm.lora.ops import triton_ops  # binds the platform at import: after it is known

    return triton_ops, vllm.__version__


class VllmPool:
    """Adapter pools in vLLM's layout, one per member of a projection (q|k|v: three): A as ours
    [slots, rank, h_in], B transposed to [slots, h_out, rank]."""

    def __init__(self, triton_ops, pools):
        self.ops = triton_ops
        self.A = [A for A, _ in pools]
        self.B = [B.transpose(1, 2).contiguous() for _, B in pools]

    def add_on(self, x, y, row_slots, specialize=True):
        """vLLM's add-on y[:, member's columns] += x·Aᵀ·B of every member (one shrink and one
        expand over all members), rows → pool slots as row_slots, one scale for all rows (vLLM's
        form). specialize: the grid spans the active adapters only, vLLM's faster setting; else
        all slots + 1 (its default)."""
        batch, rank = x.shape[0], self.A[0].shape[1]  # x: [batch, h_in], y: [batch, Σ h_out]
        meta = self.ops.LoRAKernelMeta.make(max_loras=self.A[0].shape[0], max_num_tokens=batch, device="cuda")
        meta.prepare_tensors(row_slots.to(torch.int32))
        args = meta.meta_args(batch, specialize)
        v = torch.empty(len(self.A), batch, rank, device="cuda")  # vLLM's buffer: fp32

        def run():
            self.ops.lora_shrink(x, self.A, v, *args, 1.0)
            self.ops.lora_expand(v, self.B, y, *args, offset_start=0, add_inputs=True)

        return run

    def checked_add_on(self, x, y, row_slots):
        """add_on, first checked against fp32 x·Aᵀ·B per row and member (scale 1) while y is
        fresh (timing replays grow it); y is left as it was. Returns (add_on, relative error)."""
        run = self.add_on(x, y, row_slots)
        y0 = y.clone()
        run()
        got = y.float() - y0.float()
        y.copy_(y0)
        ref = []
        for A, B in zip(self.A, self.B):
            A, B = A[row_slots].float(), B[row_slots].float()  # [rows, rank, h_in], [rows, h_out, rank]
            ref.append(torch.bmm(torch.bmm(x.float()[:, None, :], A.transpose(1, 2)), B.transpose(1, 2))[:, 0])
        ref = torch.cat(ref, dim=1)
        err = float((got - ref).norm() / ref.norm())
        assert err < 2e-2, f"vLLM rank {self.A[0].shape[1]}, {x.shape[0]} rows: rel err {err:.1e}"
        return run, err
