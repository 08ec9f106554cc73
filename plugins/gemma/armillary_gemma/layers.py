"""Gemma attention and GeGLU MLP over core's shared layers: q/k norms, per-type rope, windows, KV sharing.

Gemma 3: scale ``query_pre_attn_scalar ** -0.5``, (1 + w) q/k norms. Gemma 4: scale 1 (q and k are
RMS-normed), plain-w q/k norms, an unscaled RMSNorm on the values, global layers with their own
head_dim / kv heads and, with ``attention_k_eq_v``, values taken from the key projection before
its norm. A KV-shared layer (Gemma 4's last ``num_kv_shared_layers``) has only a query
projection and attends over the cache of the layer it shares with (``cache_layout`` gives it
none). Every kernel goes through ``armillary.kernels.ops`` or the plugin's fused ops (CUDA-graph safe,
no host lists); Gemma 4's q / k / v norms, rope and K/V store are one launch (``ops.qkv_rope``).
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.kernels.activation import act_and_mul
from armillary.layers import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RMSNorm,
                              RowParallelLinear)
from armillary.layers.quantization.unquantized import UnquantizedLinearMethod
from armillary.parallel import get_parallel
from armillary_gemma.config import GemmaArgs
from armillary_gemma.ops import gemv
from armillary_gemma.ops.geglu import gelu_tanh_and_mul
from armillary_gemma.ops.qkv_rope import qkv_norm_rope_store

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_QK = {"q_proj": 0, "k_proj": 1}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def stacked_pieces(local_name: str, tensor: torch.Tensor, stacked: str, shards: dict) -> list | None:
    """``q_proj.weight`` -> ``[("qkv_proj.weight", tensor, {"shard_id": "q"})]``; None for other names."""
    proj, _, kind = local_name.partition(".")
    if proj not in shards or kind not in ("weight", "bias"):
        return None
    return [(f"{stacked}.{kind}", tensor, {"shard_id": shards[proj]})]


class GemmaAttention(nn.Module):
    def __init__(self, args: GemmaArgs, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        la = args.layers[layer_idx]
        tp = get_parallel().tp_size
        self.head_dim, self.window, self.kv_source = la.head_dim, la.window, la.kv_source
        self.shared, self.k_eq_v, self.gemma4 = la.kv_source != layer_idx, la.k_eq_v, args.version == 4
        self.scale, self.softcap, self.eps = args.scale, args.attn_softcap, args.rms_norm_eps
        self.num_heads, q_size = args.num_heads // tp, args.num_heads * la.head_dim
        bias, hidden = args.attention_bias, args.hidden_size
        if self.shared:
            self.q_proj = ColumnParallelLinear(hidden, q_size, bias, prefix=f"{prefix}.q_proj")
        elif self.k_eq_v:  # Gemma 4 global layers: values are the key projection (no v_proj)
            if la.num_kv_heads % tp:
                raise ValueError(f"{la.num_kv_heads} kv heads with attention_k_eq_v do not split over tp {tp}")
            self.qk_proj = MergedColumnParallelLinear(hidden, [q_size, la.num_kv_heads * la.head_dim], bias,
                                                      prefix=f"{prefix}.qk_proj")
            self.num_kv_heads = la.num_kv_heads // tp
        else:
            self.qkv_proj = QKVParallelLinear(hidden, la.head_dim, args.num_heads, la.num_kv_heads, bias,
                                              prefix=f"{prefix}.qkv_proj")
            self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * la.head_dim
        self.o_proj = RowParallelLinear(q_size, hidden, bias, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(la.head_dim, args.rms_norm_eps, zero_centered=args.zero_centered)
        if not self.shared:
            self.k_norm = RMSNorm(la.head_dim, args.rms_norm_eps, zero_centered=args.zero_centered)
            if self.gemma4:  # v_norm has no weight: x̂ · 1
                self.register_buffer("v_norm_weight", torch.ones(la.head_dim), persistent=False)

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``{q,k,v}_proj.*`` -> their slot of the stacked projection (a shared layer keeps ``q_proj``)."""
        if self.shared:
            return None
        if self.k_eq_v:
            return stacked_pieces(local_name, tensor, "qk_proj", _QK)
        return stacked_pieces(local_name, tensor, "qkv_proj", _QKV)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; cos, sin: [T, head_dim // 2]; ``cache``: this layer's, or its KV source's -> [T, H]."""
        n, d = x.shape[0], self.head_dim
        if self.shared:
            q = self.q_proj(x).view(n, self.num_heads, d)
            q = ops.apply_rotary(ops.rms_norm(q, self.q_norm.weight, self.eps, zero_centered=False), cos, sin)
        else:
            kv = self.num_kv_heads * d
            if self.k_eq_v:
                q, k = self.qk_proj(x).split([self.q_size, kv], dim=-1)
                v = k
            else:
                q, k, v = self.qkv_proj(x).split([self.q_size, kv, kv], dim=-1)
            q, k, v = q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d)
            if self.gemma4:  # [T, Hkv, D] values normed without a scale too: q, k, v norms + rope + store, one launch
                q = qkv_norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, self.v_norm_weight,
                                        self.eps, cos, sin, cache, batch)
            else:
                q = ops.qk_norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, self.eps, cos, sin,
                                           cache, batch, zero_centered=True)
        attn = ops.attention(q, cache, batch, self.scale, sliding_window=self.window, softcap=self.softcap)
        return self.o_proj(attn.reshape(n, self.q_size))


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) · up(x)), gate and up in one projection; at decode sizes, where the table
    says so, the GeGLU runs inside the down projection's GEMV (``ops.gemv``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, prefix=f"{prefix}.down_proj")
        # the fused GeGLU GEMV reads a plain weight of the whole layer (no quantization, no tensor parallelism)
        self.fusable = isinstance(self.down_proj.quant_method, UnquantizedLinearMethod) and get_parallel().tp_size == 1
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma MLPs use gelu_pytorch_tanh, not {activation!r}")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        return stacked_pieces(local_name, tensor, "gate_up_proj", _GATE_UP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [T, 2I]
        down = self.down_proj
        if self.fusable and gemv.serves("geglu", h, down.weight):  # GeGLU inside the down GEMV: one launch
            return gemv.gemma_gemv("geglu", h, down.weight)
        h = gelu_tanh_and_mul(h) if ops.use_triton(h) else act_and_mul(h, "gelu_pytorch_tanh")
        return down(h)
