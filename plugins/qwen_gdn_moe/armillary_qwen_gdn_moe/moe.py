"""Sparse MoE block: softmax top-k router, stacked SwiGLU experts, sigmoid-gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.kernels import ops
from armillary_qwen_gdn_moe.config import QwenHybridConfig
from armillary_qwen_gdn_moe.layers import SwiGLUMLP, empty_parameter, linear


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
    def __init__(self, cfg: QwenHybridConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = linear(cfg.hidden_size, cfg.num_experts)
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        topk_weights, topk_ids = ops.softmax_topk(self.gate(x), self.top_k, self.renormalize)
        routed = self.experts(x, topk_weights, topk_ids)
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
