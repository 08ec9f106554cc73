"""Sparse MoE block of glm4_moe_lite: sigmoid router with ``e_score_correction_bias`` (group-limited when
``n_group`` > 1), routed experts and always-on shared experts in one core ``FusedMoE``.

The router (``gate``) keeps float32 weights and logits, as transformers does (its weight stays
float32 in a bf16 model); decode rows take ``ops/router_topk.py`` on Triton (logits and top-k in one launch,
x widened inside the kernel), more rows ``ops/router.py``'s logits (prefill: three bf16 tensor-core dots of
the split float32 weight) then the dispatched ``sigmoid_topk``. Routed
weights are the chosen experts' unbiased sigmoid scores, renormalised (``norm_topk_prob``) and times
``routed_scaling_factor``. The shared MLP (``shared_experts``, ``n_shared_experts ×
moe_intermediate_size`` wide) is cut into
``n_shared_experts`` experts of the routed width, stored after the routed ones with weight 1:
an MLP's output is the sum of its column blocks' outputs, so this is the same sum in one call.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from armillary.errors import WeightLoadError
from armillary.kernels import ops
from armillary.layers import FusedMoE
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.ops import router as router_ops, router_topk

_SHARED = re.compile(r"shared_experts\.(?P<proj>gate|up|down)_proj\.weight")


class Router(nn.Module):
    """``weight`` [E, H] and ``e_score_correction_bias`` [E], both float32 whatever the model dtype."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> float32 logits [T, E]; on Triton in one launch (the cast folded in)."""
        if x.stride(-1) == 1 and ops.use_triton(x):
            if x.shape[0] <= router_ops.MAX_ROWS:
                return router_ops.router_logits(x, self.weight)
            if x.dtype == torch.bfloat16:
                cfg = router_ops.mma_config(self.weight.shape[0], x.shape[1], x.shape[0], x.device)
                if x.shape[0] >= cfg["min_rows"]:
                    return router_ops.router_logits_mma(x, self.weight, config=cfg)
        return F.linear(x.float(), self.weight)


class MoEBlock(nn.Module):
    def __init__(self, cfg: GlmFlashConfig, prefix: str = "") -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.num_shared, self.inter = cfg.n_shared_experts, cfg.moe_intermediate_size
        # group-limited choice (only the experts of the topk_group best of n_group groups); 1 group: plain top-k
        self.groups = {"n_group": cfg.n_group, "topk_group": cfg.topk_group} if cfg.n_group > 1 else {}
        self.gate = Router(cfg.hidden_size, cfg.n_routed_experts)
        self.experts = FusedMoE(cfg.n_routed_experts, self.top_k, cfg.hidden_size, cfg.moe_intermediate_size,
                                cfg.hidden_act, num_shared=self.num_shared, prefix=f"{prefix}.experts")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``shared_experts.{gate,up,down}_proj.weight`` -> experts E.. of ``experts``, one column block each."""
        m = _SHARED.fullmatch(local_name)
        if m is None:
            return None
        width = self.num_shared * self.inter
        dim = 1 if m["proj"] == "down" else 0
        if tensor.shape[dim] != width:
            raise WeightLoadError(f"{local_name}: expects {width} = n_shared_experts × moe_intermediate_size along "
                                  f"dim {dim}, got shape {tuple(tensor.shape)}")
        param = "down_proj" if m["proj"] == "down" else "gate_up_proj"
        return [(f"experts.{param}", part, {"shard_id": m["proj"], "expert_id": self.experts.shared_expert_id(i)})
                for i, part in enumerate(tensor.split(self.inter, dim=dim))]

    def _fused_router(self, x: torch.Tensor) -> bool:
        """Whether decode rows take the one-launch router (logits + top-k, ``ops/router_topk.py``)."""
        return (x.stride(-1) == 1 and ops.use_triton(x) and self.gate.weight.is_contiguous()
                and x.shape[0] <= router_topk.max_rows(x.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        if self._fused_router(x):
            weights, ids = router_topk.router_topk(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                                   self.renormalize, self.scaling, self.num_shared, **self.groups)
            return self.experts(x, weights, ids)
        logits = self.gate(x)  # [T, E] float32
        weights, ids = ops.sigmoid_topk(logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize,
                                        self.scaling, self.num_shared, **self.groups)  # [T, k + S]
        return self.experts(x, weights, ids)
