"""Gated full attention: per-head [query | gate] projection, zero-centred q/k norms, partial RoPE,
paged KV, output ``o_proj(attn · sigmoid(gate))``.

Qwen3.5's interleaved M-RoPE gives every frequency one of the three (t, h, w) position streams;
for text the three streams are equal, so it is exactly this plain partial RoPE.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.layers import QKVParallelLinear, RMSNorm, RowParallelLinear
from armillary_qwen_gdn_moe.config import QwenHybridConfig


class GatedAttention(nn.Module):
    """``qkv_proj`` rows [q | k | v], q per head [query | gate] (checkpoint ``q_proj`` as stored),
    ``o_proj``, ``q_norm`` / ``k_norm``; head counts are this tensor-parallel rank's."""

    def __init__(self, cfg: QwenHybridConfig, prefix: str = "") -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        # q_proj, k_proj and v_proj stacked: one projection launch per step
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias, q_size=2 * cfg.num_attention_heads * self.head_dim,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, hidden, bias,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.scale = self.head_dim**-0.5

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``{q,k,v}_proj.{weight,bias}`` -> shard q / k / v of ``qkv_proj`` (names relative to this module)."""
        proj, _, kind = local_name.partition(".")
        if proj not in ("q_proj", "k_proj", "v_proj") or kind not in ("weight", "bias"):
            return None
        return [(f"qkv_proj.{kind}", tensor, {"shard_id": proj[0]})]

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, H]; cos, sin: [T, rotary_dim // 2] -> [T, H]. Writes the new K/V to ``cache``."""
        num_tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # q/k norms, rotary and the K/V store in one launch on the GPU (both norms use cfg.rms_norm_eps)
        q = ops.qk_norm_rope_store(query, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                                   cache, batch)  # [T, Hq, D]
        attn = ops.attention(q, cache, batch, self.scale, gate=gate)  # [T, Hq, D] · sigmoid(gate), fused
        return self.o_proj(attn.reshape(num_tokens, -1))
