"""Nemotron-H feed-forward blocks: the relu² MoE (sigmoid router + correction bias, group-limited top-k,
routed and shared experts through core's ``FusedMoE``) and the dense relu² MLP.

The shared expert runs inside the same ``FusedMoE`` call as pseudo-experts of the routed width
(Nano: 3712 = 2 × 1856) with weight 1: exact, since relu² is elementwise and down_proj linear. A
shared width that is not a multiple of the routed one runs as its own MLP.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from armillary.errors import WeightLoadError
from armillary.kernels import ops
from armillary.kernels.activation import get_activation
from armillary.layers import ColumnParallelLinear, FusedMoE, RowParallelLinear
from armillary.layers.collectives import all_reduce
from armillary.parallel import get_parallel
from armillary_nemotron.config import NemotronHArgs

_SHARED = re.compile(r"shared_experts\.(?P<proj>up|down)_proj\.(?P<attr>.+)")


class ReluSquaredMLP(nn.Module):
    """down(act(up(x))): the ``-`` layers and a shared expert that cannot be stacked."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, reduce_results: bool = True,
                 prefix: str = "") -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(inter, hidden, bias, reduce_results=reduce_results,
                                           prefix=f"{prefix}.down_proj")
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class TopkRouter(nn.Module):
    """``weight`` [E, H] and ``e_score_correction_bias`` [E], both float32 (as the checkpoint keeps them)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> float32 logits [T, E] (fp32 GEMM: the routing choice is sensitive to rounding)."""
        if ops.use_triton(x):  # one launch, x widened in registers (no fp32 copy, no cuBLAS dot + reduce)
            from armillary_nemotron.ops.router import router_logits

            return router_logits(x, self.weight)
        return F.linear(x.float(), self.weight)


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: NemotronHArgs, prefix: str = "") -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.scaling, self.n_group, self.topk_group = cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group
        self.num_experts, self.inter = cfg.num_experts, cfg.moe_intermediate_size
        self.tp_size = get_parallel().tp_size  # the separate shared expert's split (the experts' is 1 under EP)
        shared = cfg.shared_intermediate_size  # one shared MLP of this width, whatever n_shared_experts says
        stackable = shared and shared % self.inter == 0 and not cfg.mlp_bias  # routed experts have no bias
        self.num_pseudo = shared // self.inter if stackable else 0
        self.gate = TopkRouter(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedMoE(cfg.num_experts, cfg.top_k, cfg.hidden_size, self.inter, cfg.mlp_act,
                                num_shared=self.num_pseudo, gated=False, prefix=f"{prefix}.experts")
        self.shared_experts = None
        if shared and not self.num_pseudo:
            self.shared_experts = ReluSquaredMLP(cfg.hidden_size, shared, cfg.mlp_act, cfg.mlp_bias,
                                                 reduce_results=False, prefix=f"{prefix}.shared_experts")
            self.experts.reduce_results = False  # both branches are summed once, after adding them

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """A stacked shared expert's ``shared_experts.{up,down}_proj.<attr>`` -> pseudo-experts E, E+1, ...

        ``weight`` [S, H] (up: rows) / [H, S] (down: columns) splits into S / I slices; a quantized
        checkpoint's per-block scales (``weight_scale_inv`` ...) split the same way, into equal parts."""
        m = _SHARED.fullmatch(local_name)
        if m is None or not self.num_pseudo:
            return None
        dim = 0 if m["proj"] == "up" else 1
        if tensor.dim() < 2:
            dim = 0  # a per-tensor scale: nothing to split along the intermediate dim
        if tensor.dim() < 2 or tensor.shape[dim] % self.num_pseudo:
            raise WeightLoadError(f"{local_name}: {tuple(tensor.shape)} does not split into the {self.num_pseudo} "
                                  f"pseudo-experts of width {self.inter} the shared expert is stacked as")
        base = "gate_up_proj" if m["proj"] == "up" else "down_proj"
        param = base if m["attr"] == "weight" else f"{base}_{m['attr']}"  # FusedMoE's names for quantized tensors
        return [(f"experts.{param}", piece, {"shard_id": m["proj"], "expert_id": self.experts.shared_expert_id(i)})
                for i, piece in enumerate(tensor.chunk(self.num_pseudo, dim=dim))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E] float32
        weights, ids = ops.sigmoid_topk(logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize,
                                        self.scaling, self.num_pseudo, n_group=self.n_group,
                                        topk_group=self.topk_group)
        out = self.experts(x, weights, ids)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)  # partial over the TP ranks (whole at TP 1)
        if self.experts.ep_size > 1 and self.tp_size > 1:  # experts and shared width split over the same ranks
            return all_reduce(out + shared, self.tp_size, "tp")
        out = all_reduce(out, self.experts.ep_size, "ep") + shared
        return all_reduce(out, self.tp_size, "tp")
