"""Nemotron-H attention: GQA over the paged KV cache, no rotary embedding (position comes from the Mamba layers)."""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.layers import QKVParallelLinear, RowParallelLinear
from armillary_nemotron.config import NemotronHArgs

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}


class NemotronHAttention(nn.Module):
    """``{q,k,v}_proj`` stacked into ``qkv_proj``; ``o_proj``; scale head_dim^-0.5."""

    def __init__(self, cfg: NemotronHArgs, prefix: str = "") -> None:
        super().__init__()
        # no bias, as transformers builds it whatever attention_bias says (config.py warns when it is set)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, False,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = cfg.head_dim, self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, prefix=f"{prefix}.o_proj")
        self.scale = self.head_dim**-0.5

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``{q,k,v}_proj.{weight,bias}`` and FP8 checkpoints' block / channel scales beside them -> their
        slot of ``qkv_proj`` (whose quant method owns the scale parameter)."""
        proj, _, kind = local_name.partition(".")
        if proj not in _QKV or kind not in ("weight", "bias", "weight_scale_inv", "weight_scale"):
            return None
        return [(f"qkv_proj.{kind}", tensor, {"shard_id": _QKV[proj]})]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        ops.store_kv(cache, k.view(num_tokens, self.num_kv_heads, self.head_dim),
                     v.view(num_tokens, self.num_kv_heads, self.head_dim), batch)
        attn = ops.attention(q, cache, batch, self.scale)  # [T, Hq, D]
        return self.o_proj(attn.reshape(num_tokens, self.q_size))
