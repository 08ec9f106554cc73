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
from armillary_qwen_gdn_moe.config import QwenHybridConfig
from armillary_qwen_gdn_moe.layers import ZeroCenteredRMSNorm, linear


class GatedAttention(nn.Module):
    def __init__(self, cfg: QwenHybridConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_size = 2 * self.num_heads * self.head_dim  # per head [query | gate]
        self.kv_size = self.num_kv_heads * self.head_dim
        # q_proj, k_proj and v_proj stacked: one projection launch per step
        self.qkv_proj = linear(hidden, self.q_size + 2 * self.kv_size, bias)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden, bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def checkpoint_slot(self, local_name: str) -> tuple[str, tuple] | None:
        """Where ``{q,k,v}_proj.{weight,bias}`` land inside ``qkv_proj`` (name relative to this module)."""
        proj, _, kind = local_name.partition(".")
        starts = {"q_proj": 0, "k_proj": self.q_size, "v_proj": self.q_size + self.kv_size}
        if proj not in starts or kind not in ("weight", "bias"):
            return None
        size = self.q_size if proj == "q_proj" else self.kv_size
        return f"qkv_proj.{kind}", (slice(starts[proj], starts[proj] + size),)

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
