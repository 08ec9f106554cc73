"""Gemma decoder layers: four RMSNorms around attention and the MLP; Gemma 4's MoE block, per-layer input
and layer scalar.

Gemma 3: ``r += post_attn_norm(attn(input_norm(r)))``, ``r += post_ff_norm(mlp(pre_ff_norm(r)))``;
the residual stream travels beside the layer output, so each "norm, add, norm" between two
sublayers (across layer boundaries too) is one ``ops.norm.norm_add_norm`` launch. Gemma 4
adds, in this order: the MoE block in parallel with the dense MLP (router and experts read the
post-attention residual), the per-layer input ``r += post_ple_norm(proj(gelu(gate(r)) · ple_i))``
(E2B / E4B) and ``r *= layer_scalar``; its layers take the stream with its input norm and return the
next stream with the next layer's input norm, so on the GPU the norms after attention (and, at decode
sizes, the router's projection) are one launch (``ops.layer_norms.attn_out_norms``) and everything after
the MLP and experts is another (``layer_tail``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.layers import FusedMoE, ReplicatedLinear, RMSNorm
from armillary.layers.quantization.unquantized import UnquantizedLinearMethod
from armillary_gemma.config import GemmaArgs, MoEArgs
from armillary_gemma.layers import GemmaAttention, GemmaMLP
from armillary_gemma.ops.layer_norms import attn_out_norms, layer_tail
from armillary_gemma.ops.norm import norm_add_norm
from armillary_gemma.ops.router import gemma4_route


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
    stacked GeGLU experts through core's ``FusedMoE``; the router's input norm comes from ``attn_out_norms``."""

    def __init__(self, args: GemmaArgs, moe: MoEArgs, prefix: str = "") -> None:
        super().__init__()
        hidden = args.hidden_size
        self.top_k, self.root = moe.top_k, hidden**-0.5
        self.router = nn.Module()
        self.router.proj = ReplicatedLinear(hidden, moe.num_experts, prefix=f"{prefix}.router.proj")
        self.router.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.router.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden, moe.intermediate_size, "gelu_pytorch_tanh",
                                prefix=f"{prefix}.experts")

    def router_weight(self) -> torch.Tensor | None:
        """The router projection's plain weight [E, H], which ``attn_out_norms`` applies itself; None if quantized."""
        proj = self.router.proj
        return proj.weight if isinstance(proj.quant_method, UnquantizedLinearMethod) else None

    def forward(self, router_out: torch.Tensor, expert_in: torch.Tensor, logits: bool) -> torch.Tensor:
        """router_out: the router logits [T, E] (``logits``) or its input x̂ · scale · H^-½ [T, H]; expert_in:
        the stream's pre-expert norm [T, H] -> [T, H]."""
        router_logits = router_out if logits else self.router.proj(router_out)
        weights, ids = gemma4_route(router_logits, self.router.per_expert_scale, self.top_k)  # [T, k] each
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

    def forward(self, x: torch.Tensor, h: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor, per_layer_input: torch.Tensor | None,
                next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, H], h: its input norm (the previous layer's tail made it); per_layer_input:
        [T, P] or None; next_norm: the next layer's input-norm weight (the final norm's after the last layer)
        -> (the next residual stream, its ``next_norm``). At decode sizes: attention's launches, one norm launch
        after it, the MLP's and the experts', one at the end."""
        eps = self.input_layernorm.eps
        a = self.self_attn(h, batch, cache, cos, sin)
        moe = self.moe
        router_w = moe.router_weight() if moe is not None else None
        mlp_in, expert_in, router_out, x = attn_out_norms(
            a, x, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
            self.pre_feedforward_layernorm_2.weight if moe is not None else None,
            moe.router.scale if moe is not None else None, moe.root if moe is not None else 1.0, eps, router_w)
        m = self.mlp(mlp_in)
        e = moe(router_out, expert_in, logits=router_w is not None) if moe is not None else None
        w1 = self.post_feedforward_layernorm_1.weight if moe is not None else None
        w2 = self.post_feedforward_layernorm_2.weight if moe is not None else None
        if not self.per_layer_dim:
            return layer_tail(m, e, x, w1, w2, self.post_feedforward_layernorm.weight, self.layer_scalar, next_norm,
                              eps)
        x, _ = layer_tail(m, e, x, w1, w2, self.post_feedforward_layernorm.weight, None, None, eps)
        g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input  # [T, P]
        return layer_tail(self.per_layer_projection(g), None, x, None, None, self.post_per_layer_input_norm.weight,
                          self.layer_scalar, next_norm, eps)
