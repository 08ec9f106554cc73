"""Gemma 4's router tail in one Triton launch: softmax over the experts, top-k, renormalise, · per-expert scale.

Core's routing kernels (``moe_routing``) have no per-expert output scale; unfused that is the route
launch plus an index and a multiply. float32 throughout, as transformers' router computes it
(softmax in float32, ``weights / sum``, then ``· per_expert_scale[ids]``); ties go to the lower expert
id, as ``torch.topk``'s. The reference is ``naive.gemma4_route_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops
from armillary.kernels.triton.host import next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue


@triton.jit
def _gemma4_route_kernel(logits_ptr, scale_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                         TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program a token: weights [T, k] float32, ids [T, k] int32 (descending weight)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    ok = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=ok, other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    choice = tl.where(ok, probs, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        picked = tl.where(slots == slot, tl.sum(tl.where(experts == best, probs, 0.0), axis=0), picked)
        picked_ids = tl.where(slots == slot, best.to(tl.int32), picked_ids)
        choice = tl.where(experts == best, float("-inf"), choice)
    picked = picked / tl.sum(picked, axis=0)
    in_k = slots < TOP_K
    scale = tl.load(scale_ptr + picked_ids, mask=in_k, other=0.0).to(tl.float32)
    tl.store(weights_ptr + token * TOP_K + slots, picked * scale, mask=in_k)
    tl.store(ids_ptr + token * TOP_K + slots, picked_ids, mask=in_k)


def gemma4_route_triton(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                        top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (unit last stride); per_expert_scale: [E] -> (weights [T, k] float32, ids [T, k] int32)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or per_expert_scale.shape != (logits.shape[1],):
        raise ValueError(f"gemma4_route: logits {tuple(logits.shape)} and per_expert_scale "
                         f"{tuple(per_expert_scale.shape)} must be [T, E] and [E]")
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"gemma4_route: top_k {top_k} must be in 1..{experts}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        block_e = next_power_of_2(experts)
        _gemma4_route_kernel[(tokens,)](logits, per_expert_scale.contiguous(), weights, ids, experts,
                                        logits.stride(0), TOP_K=top_k, BLOCK_E=block_e,
                                        BLOCK_K=next_power_of_2(top_k),
                                        num_warps=1 if block_e <= 1024 else 4, **launch_options(logits.device))
    return weights, ids


def gemma4_route(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch where Triton serves ``logits``; core's softmax top-k and a gather elsewhere."""
    if ops.use_triton(logits):
        return gemma4_route_triton(logits, per_expert_scale, top_k)
    weights, ids = ops.softmax_topk(logits, top_k, renormalize=True)  # [T, k] each
    return weights * per_expert_scale[ids], ids
