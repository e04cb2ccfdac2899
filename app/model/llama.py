"""Llama-family forward on `ops`: fused QKV and gate/up, RoPE, GQA over paged KV,
SwiGLU, and the multi-LoRA add-on on any of the seven projections."""
from __future__ import annotations

import torch

from app.model.config import ModelConfig
from app.model.inputs import LoraSegments, StepInputs
from app.model.weights import FUSED, ModelWeights
from ops.activation import silu_mul
from ops.attention import paged_attention
from ops.lora import LoraSlice, add_lora
from ops.norms import add_rms_norm, rms_norm
from ops.rope import rope_and_cache, rope_cos_sin


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora_pool=None, reduce=None):
        """reduce(y) → y: sums the o and down outputs over tensor-parallel shards (LoRA add-on
        included, see app/model/tensor_parallel.py); None on a single GPU."""
        self.cfg = cfg
        self.reduce = reduce or (lambda y: y)
        self.w = weights
        self.lora_pool = lora_pool
        self.dtype = weights.embed.dtype
        self.scale = cfg.head_dim**-0.5
        self.inv_freq = cfg.inv_freq.to(weights.embed.device)
        self._out_dims = {m: d_out for m, (_, d_out) in cfg.module_dims.items()}

    @torch.inference_mode()
    def forward(self, inp: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [n, vocab] (fp32) for ``inp.sample_rows``; writes this step's KV into kv_caches."""
        cos, sin = rope_cos_sin(inp.positions, self.inv_freq, self.cfg.rope_scaling, self.dtype)
        eps = self.cfg.rms_norm_eps
        h = self.w.embed[inp.token_ids]  # h: [tokens, hidden], the residual stream (updated in place)
        x = rms_norm(h, self.w.layers[0].input_norm, eps) if self.w.layers else h
        for i, layer in enumerate(self.w.layers):
            x = add_rms_norm(h, self._attention(i, x, inp, cos, sin, kv_caches[i]), layer.post_norm, eps)
            delta = self._mlp(i, x, inp.lora)
            if i + 1 < len(self.w.layers):
                x = add_rms_norm(h, delta, self.w.layers[i + 1].input_norm, eps)
            else:
                h.add_(delta)
        h = rms_norm(h[inp.sample_rows], self.w.final_norm, eps)
        return (h @ self.w.lm_head.T).float()  # [n, vocab]

    def _attention(self, i, x, inp: StepInputs, cos, sin, kv):
        c = self.cfg
        qkv = self._project(i, "qkv", x, inp.lora)  # [tokens, (heads + 2 * kv_heads) * head_dim]
        q = rope_and_cache(qkv, cos, sin, kv[0], kv[1], inp.slot_mapping, c.num_heads, c.num_kv_heads, c.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [tokens, heads, head_dim]
        paged_attention(out, q, kv[0], kv[1], inp.attention, self.scale)
        return self.reduce(self._project(i, "o", out.view(-1, c.num_heads * c.head_dim), inp.lora))

    def _mlp(self, i, x, lora):
        return self.reduce(self._project(i, "down", silu_mul(self._project(i, "gate_up", x, lora)), lora))

    def _project(self, i: int, fused: str, x: torch.Tensor, lora: LoraSegments | None):
        """x @ W_fused.T plus each member module's LoRA add-on, written into its column slice."""
        y = x @ self.w.layers[i].proj[fused].T
        if lora is None:
            return y
        pool, members, offset = self.lora_pool, [], 0
        for m in FUSED[fused][1]:
            if m in lora.slot_ids:
                members.append((m, LoraSlice(pool.A[m][i], pool.B[m][i], lora.slot_ids[m], offset)))
            offset += self._out_dims[m]
        if members:
            add_lora(y, x, [s for _, s in members], lora.indptr, pool.ranks, pool.scales,
                     host_segments=None if lora.host is None else [lora.host[m] for m, _ in members])
        return y
