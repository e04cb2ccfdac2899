"""Llama-family forward on `ops`: fused QKV and gate/up, RoPE, GQA over paged KV,
SwiGLU, and the multi-LoRA add-on on any of the seven projections."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from app.model.config import ModelConfig
from app.model.inputs import LoraSegments, StepInputs
from app.model.weights import FUSED, ModelWeights
from ops.attention import paged_attention, write_kv
from ops.lora import LoraSlice, add_lora
from ops.norms import rms_norm
from ops.rope import apply_rope, rope_cos_sin


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
        h = self.w.embed[inp.token_ids]  # h: [tokens, hidden]
        for i, layer in enumerate(self.w.layers):
            x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
            h = h + self._attention(i, x, inp, cos, sin, kv_caches[i])
            x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
            h = h + self._mlp(i, x, inp.lora)
        h = rms_norm(h[inp.sample_rows], self.w.final_norm, self.cfg.rms_norm_eps)
        return (h @ self.w.lm_head.T).float()  # [n, vocab]

    def _attention(self, i, x, inp: StepInputs, cos, sin, kv):
        c = self.cfg
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self._project(i, "qkv", x, inp.lora)  # [tokens, q_dim + 2 * kv_dim]
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        write_kv(kv[0], kv[1], k, v.view(-1, c.num_kv_heads, c.head_dim), inp.slot_mapping)
        out = torch.empty_like(q)
        paged_attention(out, q, kv[0], kv[1], inp.attention, self.scale)
        return self.reduce(self._project(i, "o", out.view(-1, q_dim), inp.lora))

    def _mlp(self, i, x, lora):
        gate, up = self._project(i, "gate_up", x, lora).chunk(2, dim=-1)
        return self.reduce(self._project(i, "down", F.silu(gate) * up, lora))

    def _project(self, i: int, fused: str, x: torch.Tensor, lora: LoraSegments | None):
        """x @ W_fused.T plus each member module's LoRA add-on, written into its column slice."""
        y = x @ self.w.layers[i].proj[fused].T
        if lora is None:
            return y
        pool, members, offset = self.lora_pool, [], 0
        for m in FUSED[fused][1]:
            if lora.host[m]:
                members.append((m, LoraSlice(pool.A[m][i], pool.B[m][i], lora.slot_ids[m], offset)))
            offset += self._out_dims[m]
        if members:
            add_lora(y, x, [s for _, s in members], lora.indptr, pool.ranks, pool.scales,
                     host_segments=[lora.host[m] for m, _ in members])
        return y
