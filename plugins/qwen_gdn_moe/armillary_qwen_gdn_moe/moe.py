"""Sparse MoE block: softmax top-k router, stacked SwiGLU experts (core ``FusedMoE``), sigmoid-gated shared expert."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from armillary.errors import WeightLoadError
from armillary.kernels import ops
from armillary.layers import FusedMoE, GatedMLP, ReplicatedLinear, copy_checked
from armillary.layers.collectives import all_reduce
from armillary.parallel import get_parallel
from armillary_qwen_gdn_moe.config import QwenHybridConfig

ROUTER_ROW_MULTIPLE = 64  # cuBLAS runs a 16K x 2048 x 257 router GEMM at ~57 TFLOP/s, a padded 320-wide one fast
ROUTER_PAD_MIN_TOKENS = 64  # below this the unpadded rows are cheaper (a 320-wide GEMV: 5.4 vs 3.1 us at T=1)
_SHARED_EXPERT = re.compile(r"shared_expert\.(?P<proj>gate|up|down)_proj\.(?P<attr>.+)")


class Router(nn.Module):
    """``weight`` [E (+1), H]: the routed experts' gate rows, then (when the shared expert is fused
    into the experts) the shared expert's gate row. Never quantized.

    The weight is a view of zero-padded rows: the checkpoint fills the view, the GEMM of a long
    prefill reads all rows. ``weight_loader``: shard None = the checkpoint's ``gate.weight`` [E, H];
    "shared" = ``shared_expert_gate.weight`` [1, H].
    """

    def __init__(self, hidden_size: int, num_experts: int, with_shared: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_rows = num_experts + (1 if with_shared else 0)
        padded_rows = -(-self.num_rows // ROUTER_ROW_MULTIPLE) * ROUTER_ROW_MULTIPLE
        self.padded = torch.zeros(padded_rows, hidden_size)
        self.weight = nn.Parameter(self.padded[: self.num_rows], requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> tuple:
        if shard_id is None:
            return copy_checked(param, (slice(0, self.num_experts),), loaded, "router gate.weight")
        if shard_id != "shared" or self.num_rows == self.num_experts:
            raise WeightLoadError(f"router: no {shard_id!r} rows (routed rows: shard None; shared gate: 'shared')")
        return copy_checked(param, (slice(self.num_experts, self.num_rows),), loaded, "router shared gate row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> logits [T, E (+1)], maybe a view into the padded width."""
        router = self.padded if x.shape[0] >= ROUTER_PAD_MIN_TOKENS else self.weight
        return ops.linear(x, router)[:, : self.num_rows]


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert.

    When the shared expert is as wide as a routed one (Qwen3-Next, Qwen3.5 / 3.6), it is stored as
    expert ``E`` of the ``FusedMoE`` and its gate as row ``E`` of the router, so one routing call
    and one fused-MoE call serve both (a decode step launches a handful of kernels per layer
    instead of a dozen). Checkpoint names still map one to one (``checkpoint_pieces``).
    """

    def __init__(self, cfg: QwenHybridConfig, prefix: str = "") -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.tp_size = get_parallel().tp_size  # the shared expert's split (the experts' may differ: EP)
        self.shared_fused = cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
        self.gate = Router(cfg.hidden_size, cfg.num_experts, self.shared_fused)
        self.experts = FusedMoE(cfg.num_experts, self.top_k, cfg.hidden_size, cfg.moe_intermediate_size,
                                cfg.hidden_act, num_shared=1 if self.shared_fused else 0,
                                reduce_results=self.shared_fused, prefix=f"{prefix}.experts")
        if not self.shared_fused:
            # both branches' partial sums are reduced once, after adding them
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act,
                                          merged=False, reduce_results=False, prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """The fused shared expert's checkpoint tensors (names relative to this block) -> expert ``E``
        of ``experts`` and row ``E`` of the router; None for every other name."""
        if not self.shared_fused:
            return None
        if local_name == "shared_expert_gate.weight":
            return [("gate.weight", tensor, {"shard_id": "shared"})]
        m = _SHARED_EXPERT.fullmatch(local_name)
        if m is None:
            return None
        base = "down_proj" if m["proj"] == "down" else "gate_up_proj"
        param = base if m["attr"] == "weight" else f"{base}_{m['attr']}"  # FusedMoE's names for quantized tensors
        return [(f"experts.{param}", tensor, {"shard_id": m["proj"], "expert_id": self.experts.shared_expert_id()})]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        logits = self.gate(x)  # [T, E] or [T, E + 1] (last column: the shared expert's gate)
        if self.shared_fused:
            topk_weights, topk_ids = ops.softmax_topk_with_shared(logits, self.top_k, self.renormalize)
            return self.experts(x, topk_weights, topk_ids)
        topk_weights, topk_ids = ops.softmax_topk(logits, self.top_k, self.renormalize)
        routed = self.experts(x, topk_weights, topk_ids)  # partial: this rank's width slice or experts
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # partial over the TP ranks
        if self.experts.ep_size > 1 and self.tp_size > 1:  # both split over the same ranks: one sum
            return all_reduce(routed + shared, self.tp_size, "tp")
        routed = all_reduce(routed, self.experts.ep_size, "ep")
        return all_reduce(routed + shared, self.tp_size, "tp")
