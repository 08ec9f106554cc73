"""Gemma decoder layers: four RMSNorms around attention and the MLP; Gemma 4's MoE block, per-layer input
and layer scalar.

Gemma 3: ``r += post_attn_norm(attn(input_norm(r)))``, ``r += post_ff_norm(mlp(pre_ff_norm(r)))``;
the residual stream travels beside the layer output, so each "norm, add, norm" between two
sublayers (across layer boundaries too) is one ``ops.norm.norm_add_norm`` launch. Gemma 4
adds, in this order: the MoE block in parallel with the dense MLP (router and experts read the
post-attention residual), the per-layer input ``r += post_ple_norm(proj(gelu(gate(r)) · ple_i))``
(E2B / E4B) and ``r *= layer_scalar``, so its layers return the summed stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.layers import FusedMoE, ReplicatedLinear, RMSNorm
from armillary_gemma.config import GemmaArgs, MoEArgs
from armillary_gemma.layers import GemmaAttention, GemmaMLP
from armillary_gemma.ops.norm import norm_add_norm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        hidden, eps, zc = args.hidden_size, args.rms_norm_eps, args.zero_centered
        self.self_attn = GemmaAttention(args, layer_idx, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(hidden, args.layers[layer_idx].intermediate_size, args.hidden_act, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, zc)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zc)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, zc)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, zc)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, prev_norm: torch.Tensor | None,
                batch: ForwardBatch, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embeddings (``residual`` None) or the previous layer's raw MLP output, which its
        post-feedforward norm (weight ``prev_norm``) and the residual add still await ([T, H]) ->
        (this layer's raw MLP output, residual); each norm-add-norm is one launch on the GPU."""
        eps, zc = self.input_layernorm.eps, self.input_layernorm.zero_centered
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = norm_add_norm(x, residual, prev_norm, self.input_layernorm.weight, eps, zc)
        a = self.self_attn(h, batch, cache, cos, sin)
        h, residual = norm_add_norm(a, residual, self.post_attention_layernorm.weight,
                                    self.pre_feedforward_layernorm.weight, eps, zc)
        return self.mlp(h), residual


class Gemma4MoE(nn.Module):
    """Router (unscaled RMSNorm · scale · H^-½, softmax, top-k, renormalise, · per_expert_scale) and
    stacked GeGLU experts through core's ``FusedMoE``."""

    def __init__(self, args: GemmaArgs, moe: MoEArgs, prefix: str = "") -> None:
        super().__init__()
        hidden = args.hidden_size
        self.top_k, self.eps, self.root = moe.top_k, args.rms_norm_eps, hidden**-0.5
        self.router = nn.Module()
        self.router.proj = ReplicatedLinear(hidden, moe.num_experts, prefix=f"{prefix}.router.proj")
        self.router.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.router.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
        self.register_buffer("unit_weight", torch.ones(hidden), persistent=False)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden, moe.intermediate_size, "gelu_pytorch_tanh",
                                prefix=f"{prefix}.experts")

    def forward(self, router_in: torch.Tensor, expert_in: torch.Tensor) -> torch.Tensor:
        """router_in: the residual stream [T, H]; expert_in: its pre-expert norm [T, H] -> [T, H]."""
        h = ops.rms_norm(router_in, self.unit_weight, self.eps) * self.router.scale * self.root
        weights, ids = ops.softmax_topk(self.router.proj(h), self.top_k, renormalize=True)  # [T, k] each
        weights = weights * self.router.per_expert_scale[ids]
        return self.experts(expert_in, weights, ids)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = GemmaAttention(args, layer_idx, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(hidden, args.layers[layer_idx].intermediate_size, args.hidden_act, f"{prefix}.mlp")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)  # a checkpoint tensor
        self.moe = None
        if args.moe is not None:
            self.moe = Gemma4MoE(args, args.moe, prefix)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.per_layer_dim = args.per_layer_dim
        if self.per_layer_dim:
            self.per_layer_input_gate = ReplicatedLinear(hidden, self.per_layer_dim,
                                                         prefix=f"{prefix}.per_layer_input_gate")
            self.per_layer_projection = ReplicatedLinear(self.per_layer_dim, hidden,
                                                         prefix=f"{prefix}.per_layer_projection")
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """The checkpoint's ``router.*`` / ``experts.*`` live under this layer's ``moe``."""
        if self.moe is None or not local_name.startswith(("router.", "experts.")):
            return None
        if local_name.startswith("experts."):  # per-expert names, if a checkpoint splits them
            found = self.moe.experts.checkpoint_pieces(local_name[len("experts."):], tensor)
            if found is not None:
                return [(f"moe.experts.{p}", values, kw) for p, values, kw in found]
        return [(f"moe.{local_name}", tensor, {})]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """x: the residual stream [T, H] -> the next layer's; per_layer_input: [T, P] or None."""
        a = self.self_attn(self.input_layernorm(x), batch, cache, cos, sin)
        h, x = norm_add_norm(a, x, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                             self.input_layernorm.eps, False)
        h = self.mlp(h)
        if self.moe is not None:
            expert_in = self.pre_feedforward_layernorm_2(x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(self.moe(x, expert_in))
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_dim:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input  # [T, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar
