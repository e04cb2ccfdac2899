"""The decoder forward on `ops` for every supported family (app/model/family.py declares what
each one changes): fused QKV and gate/up, RoPE, GQA over paged KV, SwiGLU or GeGLU, and the
multi-LoRA add-on on any of the seven projections; fp8 base projections where the weights hold them."""

from __future__ import annotations

import torch

from app.model.config import ModelConfig
from app.model.inputs import LoraSegments, StepInputs
from app.model.weights import FUSED, ModelWeights
from ops.activation import gelu_tanh_mul, silu_mul
from ops.attention import paged_attention
from ops.fixed_gemm import linear
from ops.fixed_order import LIBRARY, using
from ops.fp8 import fp8_linear
from ops.lora import LoraSlice, add_lora
from ops.norms import add_rms_norm, rms_norm
from ops.rope import rope_and_cache, rope_cos_sin


class LlamaModel:
    broken: BaseException | None = None  # one GPU has no shards to fall out of step (app/engine/tp/model.py's can)

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora_pool=None, reduce=None):
        """reduce(y) → y: sums the o and down outputs over tensor-parallel shards (LoRA add-on
        included, see app/engine/tp/sharding.py); None on a single GPU."""
        self.cfg = cfg
        self.reduce = reduce or (lambda y: y)
        self.w = weights
        self.lora_pool = lora_pool
        self.dtype = weights.embed.dtype
        self.scale = cfg.softmax_scale
        device = weights.embed.device
        self.inv_freq = cfg.inv_freq.to(device)
        self.local_inv_freq = None if cfg.local_inv_freq is None else cfg.local_inv_freq.to(device)
        # HF multiplies by the scale rounded to the model dtype (Gemma)
        self.embed_scale = (
            torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype, device=device) if cfg.traits.embed_scale else None
        )
        self.act = gelu_tanh_mul if cfg.traits.gelu_tanh else silu_mul
        self._out_dims = {m: d_out for m, (_, d_out) in cfg.module_dims.items()}
        self.paths = LIBRARY  # the ops' reduction orders (ops/fixed_order.py); the engine sets its config's

    @torch.inference_mode()
    def forward(self, inp: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [n, vocab] (fp32) for ``inp.sample_rows``; writes this step's KV into kv_caches."""
        with using(self.paths):
            return self._forward(inp, kv_caches)

    def _forward(self, inp: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        c = self.cfg
        rope = rope_cos_sin(inp.positions, self.inv_freq, c.rope_scaling, self.dtype)
        local = (
            rope
            if self.local_inv_freq is None
            else rope_cos_sin(inp.positions, self.local_inv_freq, c.local_rope_scaling, self.dtype)
        )
        eps = c.rms_norm_eps
        h = self.w.embed[inp.token_ids]  # h: [tokens, hidden], the residual stream (updated in place)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        x = rms_norm(h, self.w.layers[0].input_norm, eps) if self.w.layers else h
        for i, layer in enumerate(self.w.layers):
            cos_sin = local if c.window(i) is not None else rope
            x = add_rms_norm(
                h,
                self._out_norm(self._attention(i, x, inp, *cos_sin, kv_caches[i]), layer.attn_out_norm),
                layer.post_norm,
                eps,
            )
            delta = self._out_norm(self._mlp(i, x, inp.lora), layer.mlp_out_norm)
            if i + 1 < len(self.w.layers):
                x = add_rms_norm(h, delta, self.w.layers[i + 1].input_norm, eps)
            else:
                h.add_(delta)
        h = rms_norm(h[inp.sample_rows], self.w.final_norm, eps)
        logits = linear(h, self.w.lm_head)  # in the order ops.fixed_order picks
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits.float()  # [n, vocab]

    def _out_norm(self, y, weight):
        """Gemma's norm on a block's output before the residual add; the output itself elsewhere."""
        return y if weight is None else rms_norm(y, weight, self.cfg.rms_norm_eps)

    def _attention(self, i, x, inp: StepInputs, cos, sin, kv):
        c, layer = self.cfg, self.w.layers[i]
        qkv = self._project(i, "qkv", x, inp.lora)  # [tokens, (heads + 2 * kv_heads) * head_dim]
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer.q_norm, layer.k_norm)
        q = rope_and_cache(qkv, cos, sin, kv[0], kv[1], inp.slot_mapping, c.num_heads, c.num_kv_heads, c.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [tokens, heads, head_dim]
        paged_attention(out, q, kv[0], kv[1], inp.attention, self.scale, c.window(i), c.attn_softcap)
        return self.reduce(self._project(i, "o", out.view(-1, c.num_heads * c.head_dim), inp.lora))

    def _qk_norm(self, qkv, q_weight, k_weight):
        """Per-head RMSNorm of q and k (Qwen3, Gemma 3), in place in qkv (after LoRA, before RoPE)."""
        c = self.cfg
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for lo, hi, weight in ((0, q_dim, q_weight), (q_dim, q_dim + kv_dim, k_weight)):
            part = qkv[:, lo:hi].reshape(-1, c.head_dim)
            qkv[:, lo:hi] = rms_norm(part, weight, c.rms_norm_eps).view(qkv.shape[0], hi - lo)

    def _mlp(self, i, x, lora):
        return self.reduce(self._project(i, "down", self.act(self._project(i, "gate_up", x, lora)), lora))

    def _project(self, i: int, fused: str, x: torch.Tensor, lora: LoraSegments | None):
        """x @ W_fused.T (+ bias) plus each member module's LoRA add-on, written into its column slice.
        An fp8 W (app/model/quantization.py) runs the fp8 GEMM; the LoRA add-on reads the same x."""
        layer = self.w.layers[i]
        scale = layer.scale.get(fused)
        y = (
            linear(x, layer.proj[fused], layer.bias.get(fused))
            if scale is None
            else fp8_linear(x, layer.proj[fused], scale, layer.bias.get(fused))
        )
        if lora is None:
            return y
        pool, members, offset = self.lora_pool, [], 0
        for m in FUSED[fused][1]:
            if m in lora.slot_ids:
                members.append((m, LoraSlice(pool.A[m][i], pool.B[m][i], lora.slot_ids[m], offset)))
            offset += self._out_dims[m]
        if members:
            add_lora(
                y,
                x,
                [s for _, s in members],
                lora.indptr,
                pool.ranks,
                pool.scales,
                host_segments=None if lora.host is None else [lora.host[m] for m, _ in members],
            )
        return y
