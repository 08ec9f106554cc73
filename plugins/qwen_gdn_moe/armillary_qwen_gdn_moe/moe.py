"""Sparse MoE block: softmax top-k router, stacked SwiGLU experts, sigmoid-gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.kernels import ops
from armillary_qwen_gdn_moe.config import QwenHybridConfig
from armillary_qwen_gdn_moe.layers import SwiGLUMLP, empty_parameter, linear

ROUTER_ROW_MULTIPLE = 64  # cuBLAS runs a 16K x 2048 x 257 router GEMM at ~57 TFLOP/s, a padded 320-wide one fast
ROUTER_PAD_MIN_TOKENS = 64  # below this the unpadded rows are cheaper (a 320-wide GEMV: 5.4 vs 3.1 us at T=1)


class StackedExperts(nn.Module):
    """All experts in two tensors, whatever the checkpoint layout: ``gate_up_proj`` [E, 2I, H]
    (rows [gate | up]) and ``down_proj`` [E, H, I] (transformers' fused names and shapes)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = empty_parameter(num_experts, 2 * intermediate_size, hidden_size)
        self.down_proj = empty_parameter(num_experts, hidden_size, intermediate_size)
        self.activation = activation

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation)


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert.

    When the shared expert is as wide as a routed one (Qwen3-Next, Qwen3.5 / 3.6), it is stored as
    expert ``E`` and its gate as row ``E`` of the router, so one routing call and one fused-MoE call
    serve both (a decode step launches a handful of kernels per layer instead of a dozen).
    Checkpoint names still map one to one (``checkpoint_slot``).
    """

    def __init__(self, cfg: QwenHybridConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.inter = cfg.moe_intermediate_size
        self.shared_fused = cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
        extra = 1 if self.shared_fused else 0
        self.num_router_rows = cfg.num_experts + extra
        self.gate = linear(cfg.hidden_size, self.num_router_rows)
        # the router weight is a view of zero-padded rows: the checkpoint fills the view, the GEMM reads all rows
        padded_rows = -(-self.num_router_rows // ROUTER_ROW_MULTIPLE) * ROUTER_ROW_MULTIPLE
        self.router_padded = torch.zeros(padded_rows, cfg.hidden_size)
        self.gate.weight = nn.Parameter(self.router_padded[: self.num_router_rows], requires_grad=False)
        self.experts = StackedExperts(cfg.num_experts + extra, cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.hidden_act)
        if not self.shared_fused:
            self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = linear(cfg.hidden_size, 1)

    def checkpoint_slot(self, local_name: str) -> tuple[str, tuple] | None:
        """Where a checkpoint tensor of this block (name relative to it) lands when the shared expert
        is fused: (parameter name relative to the block, index into it); None when names match."""
        if not self.shared_fused:
            return None
        e, i = self.num_experts, self.inter
        return {
            "gate.weight": ("gate.weight", (slice(0, e),)),
            "shared_expert_gate.weight": ("gate.weight", (slice(e, e + 1),)),
            "experts.gate_up_proj": ("experts.gate_up_proj", (slice(0, e),)),
            "experts.down_proj": ("experts.down_proj", (slice(0, e),)),
            "shared_expert.gate_proj.weight": ("experts.gate_up_proj", (e, slice(0, i))),
            "shared_expert.up_proj.weight": ("experts.gate_up_proj", (e, slice(i, 2 * i))),
            "shared_expert.down_proj.weight": ("experts.down_proj", (e,)),
        }.get(local_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        router = self.router_padded if x.shape[0] >= ROUTER_PAD_MIN_TOKENS else self.gate.weight
        # [T, E] or [T, E + 1] (last column: the shared expert's gate), maybe a view into the padded width
        logits = ops.linear(x, router)[:, : self.num_router_rows]
        if self.shared_fused:
            topk_weights, topk_ids = ops.softmax_topk_with_shared(logits, self.top_k, self.renormalize)
            return self.experts(x, topk_weights, topk_ids)
        topk_weights, topk_ids = ops.softmax_topk(logits, self.top_k, self.renormalize)
        routed = self.experts(x, topk_weights, topk_ids)
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
