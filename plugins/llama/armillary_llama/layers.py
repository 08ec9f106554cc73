"""The llama decoder layer: RMSNorm, GQA attention over the paged KV cache with RoPE, SwiGLU MLP.

Every kernel goes through ``armillary.kernels.ops`` (Triton on CUDA, CUDA-graph safe; the torch
references on the CPU), and nothing here reads the batch's host lists. Q, K and V share one fused
projection (``qkv_proj``), gate and up another (``gate_up_proj``): fewer, larger matmuls.
``model.load_weights`` fills them from the checkpoint's separate tensors. The layer classes stay
thin (a weight and an ops call) so that core's shared layers can replace them one for one.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.kernels.activation import act_and_mul, get_activation
from armillary_llama.config import LlamaArgs


class Linear(nn.Linear):
    """``nn.Linear`` (same ``weight`` / ``bias``) whose forward is ``ops.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """A :class:`Linear` left uninitialised on the default device (``load_weights`` fills it)."""
    return skip_init(Linear, in_features, out_features, bias=bias, device=torch.get_default_device())


class RMSNorm(nn.Module):
    """x̂ · w."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), fused on the GPU."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.q_size, args.kv_size
        self.qkv_proj = linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.attention_bias)
        self.o_proj = linear(self.q_size, args.hidden_size, args.attention_bias)
        self.scale = self.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer_idx]  # None: full attention

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
        self.gate_up_proj = linear(args.hidden_size, 2 * args.intermediate_size, args.mlp_bias)
        self.down_proj = linear(args.intermediate_size, args.hidden_size, args.mlp_bias)
        get_activation(args.hidden_act)  # fail at build time on an unknown activation
        self.activation = args.hidden_act

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
