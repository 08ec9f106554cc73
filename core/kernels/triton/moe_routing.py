"""MoE routers in one Triton launch each: softmax top-k (Qwen) and sigmoid + correction bias, group-limited (Nemotron, GLM).

Both can append shared-expert columns, so a shared expert stacked behind the routed ones in
``w13`` / ``w2`` (ids E, E+1, ...) runs inside the same ``fused_moe`` call: its weight is
sigmoid(shared gate logit) (Qwen's ``shared_expert_gate``) or 1.0 (Nemotron, GLM). A shared
expert wider than the routed ones is split into several pseudo-experts of the routed width;
that is exact because the activation is elementwise and the down projection linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    shared_logit_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    stride_shared,
    scaling,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED_GATE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    in_range = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=in_range, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + experts, mask=in_range, other=0.0).to(tl.float32)
    else:
        exps = tl.exp(logits - tl.max(logits, axis=0))
        scores = exps / tl.sum(exps, axis=0)
        choice = scores
    choice = tl.where(in_range, choice, float("-inf"))
    if N_GROUP > 1:
        # group-limited choice: a group scores its two best choices; experts outside the TOPK_GROUP best are out
        group_size = num_experts // N_GROUP
        groups = tl.arange(0, BLOCK_G)
        member = (experts[None, :] // group_size == groups[:, None]) & in_range[None, :]  # [G, E]
        in_group = tl.where(member, choice[None, :], float("-inf"))
        first = tl.max(in_group, axis=1)
        first_at = tl.argmax(in_group, axis=1)
        second = tl.max(tl.where(experts[None, :] == first_at[:, None], float("-inf"), in_group), axis=1)
        group_score = tl.where(groups < N_GROUP, first + second, float("-inf"))
        kept = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best_group = tl.argmax(group_score, axis=0)
            kept = tl.where(groups == best_group, 1, kept)
            group_score = tl.where(groups == best_group, float("-inf"), group_score)
        eligible = tl.max(tl.where(member, kept[:, None], 0), axis=0)  # [E]
        choice = tl.where(eligible > 0, choice, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    picked_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)  # ties go to the lower expert id, like torch.topk
        best_score = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
        picked_weights = tl.where(slots == slot, best_score, picked_weights)
        picked_ids = tl.where(slots == slot, best.to(tl.int32), picked_ids)
        choice = tl.where(experts == best, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(picked_weights, axis=0)
        if SIGMOID:
            total = total + 1e-20  # the DeepSeek-style routers' guard against an all-zero row
        picked_weights = picked_weights / total
    picked_weights = picked_weights * scaling

    width = TOP_K + NUM_SHARED
    if NUM_SHARED > 0:
        if HAS_SHARED_GATE:
            shared_weight = tl.sigmoid(tl.load(shared_logit_ptr + token * stride_shared).to(tl.float32))
        else:
            shared_weight = 1.0
        is_shared = (slots >= TOP_K) & (slots < width)
        picked_weights = tl.where(is_shared, shared_weight, picked_weights)
        picked_ids = tl.where(is_shared, num_experts + slots - TOP_K, picked_ids)
    out_mask = slots < width
    tl.store(weights_ptr + token * width + slots, picked_weights, mask=out_mask)
    tl.store(ids_ptr + token * width + slots, picked_ids, mask=out_mask)


def _route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    sigmoid: bool,
    bias: torch.Tensor | None,
    scaling: float,
    num_shared: int,
    shared_gate_logits: torch.Tensor | None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError("router_logits must be [T, E] with unit stride along experts")
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
    if n_group > 1 and (num_experts % n_group or num_experts // n_group < 2 or not 0 < topk_group <= n_group):
        raise ValueError(f"{num_experts} experts need n_group {n_group} groups of >= 2 and 1 <= topk_group <= n_group")
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if shared_gate_logits is not None:
        if num_shared == 0:
            raise ValueError("shared_gate_logits given but num_shared is 0")
        shared = shared_gate_logits.reshape(num_tokens, -1)  # [T, 1], may be a column of the fused router output
        shared_stride = shared.stride(0)
    else:
        shared, shared_stride = weights, 0
    block_e = next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        router_logits,
        bias if bias is not None else weights,
        shared,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        shared_stride,
        float(scaling),
        TOP_K=top_k,
        NUM_SHARED=num_shared,
        SIGMOID=sigmoid,
        HAS_BIAS=bias is not None,
        HAS_SHARED_GATE=shared_gate_logits is not None,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(width),
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        BLOCK_G=next_power_of_2(n_group),
        num_warps=1 if block_e <= 1024 else 4,  # one warp: the k argmax reductions stay in registers
        **launch_options(router_logits.device),
    )
    return weights, ids


def topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_shared: int = 0,
    shared_gate_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, keep the ``top_k`` largest (descending), optionally renormalised.

    router_logits: [T, E] (any float dtype, unit stride along E) -> (weights [T, k + S] float32,
    ids [T, k + S] int32), S = ``num_shared``: columns k.. hold shared experts E.. with weight
    sigmoid(shared_gate_logits) ([T] or [T, 1], e.g. a column view) or 1.0 when that is None.
    """
    return _route(router_logits, top_k, renormalize, False, None, 1.0, num_shared, shared_gate_logits)


def topk_sigmoid_bias(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling: float = 1.0,
    num_shared: int = 0,
    shared_gate_logits: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias: Nemotron-H, GLM-4.7-Flash, DeepSeek-V3.

    scores = sigmoid(logits); with ``n_group`` > 1 only the experts of the ``topk_group`` groups
    whose two best scores + bias sum highest are eligible (``armillary.kernels.moe.sigmoid_topk``);
    the top ``top_k`` of scores + bias ([E] float32) are chosen, their
    unbiased scores kept, renormalised (sum + 1e-20) if asked, then times ``scaling``
    (``routed_scaling_factor``; shared columns are not scaled). Returns like ``topk_softmax``.
    """
    return _route(router_logits, top_k, renormalize, True, bias, scaling, num_shared, shared_gate_logits, n_group,
                  topk_group)
