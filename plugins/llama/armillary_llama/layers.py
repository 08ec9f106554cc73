"""The llama decoder layer: RMSNorm, GQA attention over the paged KV cache with RoPE, SwiGLU MLP.

Every kernel goes through ``armillary.kernels.ops`` (Triton on CUDA, CUDA-graph safe; the torch
references on the CPU), and nothing here reads the batch's host lists. Q, K and V share one fused
projection (``qkv_proj``), gate and up another (``gate_up_proj``): fewer, larger matmuls.
The projections and norms are core's shared layers (``armillary.layers``: tensor-parallel shards,
a ``QuantMethod`` per linear); ``checkpoint_pieces`` says which slot of a stacked projection each
of the checkpoint's separate ``q/k/v_proj`` and ``gate/up_proj`` tensors fills.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.kernels.activation import act_and_mul, get_activation
from armillary.layers import MergedColumnParallelLinear, QKVParallelLinear, RMSNorm, RowParallelLinear
from armillary_llama.config import LlamaArgs

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _stacked_pieces(local_name: str, tensor: torch.Tensor, stacked: str, shards: dict) -> list | None:
    """``q_proj.weight`` -> ``[("qkv_proj.weight", tensor, {"shard_id": "q"})]``; None for other names."""
    proj, _, kind = local_name.partition(".")
    if proj not in shards or kind not in ("weight", "bias"):
        return None
    return [(f"{stacked}.{kind}", tensor, {"shard_id": shards[proj]})]


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
                                          args.attention_bias)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = args.head_dim, self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(args.q_size, args.hidden_size, args.attention_bias)
        self.scale = self.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer_idx]  # None: full attention

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``{q,k,v}_proj.{weight,bias}`` -> their slot of ``qkv_proj``."""
        return _stacked_pieces(local_name, tensor, "qkv_proj", _QKV)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; cos, sin: [T, head_dim // 2] -> [T, H]. Writes the new K/V to ``cache``."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, Hq, D]
        k = ops.apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        ops.store_kv(cache, k, v.view(num_tokens, self.num_kv_heads, self.head_dim), batch)
        attn = ops.attention(q, cache, batch, self.scale, sliding_window=self.sliding_window)  # [T, Hq, D]
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) · up(x))."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [args.intermediate_size] * 2, args.mlp_bias)
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, args.mlp_bias)
        get_activation(args.hidden_act)  # fail at build time on an unknown activation
        self.activation = args.hidden_act

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``{gate,up}_proj.{weight,bias}`` -> their slot of ``gate_up_proj``."""
        return _stacked_pieces(local_name, tensor, "gate_up_proj", _GATE_UP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.activation))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the layer output, so each residual add is fused into the
    next norm (``RMSNorm.add``); the first layer gets ``residual=None``.
    """

    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this block's input before its residual add ([T, H]) -> (mlp output, residual stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, batch, cache, cos, sin), residual)
        return self.mlp(h), residual
