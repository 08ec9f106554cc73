"""The entry of a decode-step MoE block in one launch: residual add + RMSNorm, the router GEMV and
softmax top-k routing (with a fused shared expert's sigmoid gate).

At batch 1 these are three latency-bound launches per layer (RMSNorm 1.8 µs, router GEMV 3.0 µs,
routing 2.9 µs on an H200) for 1 MB of router weights. Here program (n, t) re-normalises token t's
row itself (8 KB from L2), multiplies BLOCK_N router rows by it, and writes its logits; the last
program of the token to finish (an acq_rel ticket, reset by that program, so CUDA-graph replays
start from zero) ranks the experts. Rounding follows the unfused ops: the residual sum, the normed
row and the logits are rounded to the model dtype where those ops store them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.moe_routing import pick_top_k
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.triton.skinny_gemm import ticket_buffer
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary.kernels"
# off unless a target's table turns it on: on an H200 this first config took 10.4 µs per layer at batch 1,
# slower than the three launches it replaces (7.8 µs), so sm_90 keeps them until a sweep finds better tiles
DEFAULTS = {"max_tokens": 0, "BLOCK_N": 4, "num_warps": 4}


@triton.jit
def _add_norm_route_kernel(
    h_ptr, res_ptr, norm_w_ptr, router_ptr, x_out_ptr, res_out_ptr, logits_ptr, weights_ptr, ids_ptr, ticket_ptr,
    H, num_rows, num_experts, stride_h, stride_r, stride_router, eps,
    TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, RENORMALIZE: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(num_rows, BLOCK_N), T). num_rows = experts + NUM_SHARED router rows (the shared
    expert's gate last); logits_ptr: [T, num_rows] fp32 scratch; ticket_ptr: [T] int32, 0 between calls."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    dtype = x_out_ptr.dtype.element_ty
    summed = tl.load(h_ptr + t * stride_h + cols, mask=col_ok, other=0.0).to(tl.float32) \
        + tl.load(res_ptr + t * stride_r + cols, mask=col_ok, other=0.0).to(tl.float32)
    summed = summed.to(dtype).to(tl.float32)  # the residual stream keeps the model dtype
    rstd = 1.0 / tl.sqrt(tl.sum(summed * summed, axis=0) / H + eps)
    w = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    x = (summed * rstd * w).to(dtype)  # [BLOCK_H]: what the unfused norm stores
    if pid_n == 0:
        tl.store(res_out_ptr + t * H + cols, summed.to(dtype), mask=col_ok)
        tl.store(x_out_ptr + t * H + cols, x, mask=col_ok)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    wr = tl.load(router_ptr + rows[:, None].to(tl.int64) * stride_router + cols[None, :],
                 mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_H]
    logits = tl.sum(wr.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    logits = logits.to(dtype).to(tl.float32)  # the unfused GEMV returns model-dtype logits
    tl.store(logits_ptr + t * num_rows + rows, logits, mask=row_ok)

    tl.debug_barrier()  # every lane's logits are written before the ticket publishes them
    ticket = tl.atomic_add(ticket_ptr + t, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        # the token's last program: all its logits are visible; softmax top-k as routing does it
        experts = tl.arange(0, BLOCK_E)
        in_range = experts < num_experts
        all_logits = tl.load(logits_ptr + t * num_rows + experts, mask=in_range, other=float("-inf"),
                             cache_modifier=".cg")
        exps = tl.exp(all_logits - tl.max(all_logits, axis=0))
        scores = exps / tl.sum(exps, axis=0)
        choice = tl.where(in_range, scores, float("-inf"))
        slots = tl.arange(0, BLOCK_K)
        picked_w, picked_ids = pick_top_k(choice, scores, experts, TOP_K, BLOCK_K)
        if RENORMALIZE:
            picked_w = picked_w / tl.sum(picked_w, axis=0)
        width = TOP_K + NUM_SHARED
        if NUM_SHARED > 0:
            shared_logit = tl.load(logits_ptr + t * num_rows + num_experts, cache_modifier=".cg")
            is_shared = slots == TOP_K
            picked_w = tl.where(is_shared, tl.sigmoid(shared_logit), picked_w)
            picked_ids = tl.where(is_shared, num_experts, picked_ids)
        tl.store(weights_ptr + t * width + slots, picked_w, mask=slots < width)
        tl.store(ids_ptr + t * width + slots, picked_ids, mask=slots < width)
        tl.store(ticket_ptr + t, 0)  # no other program of this call touches the ticket any more


def serves(h: torch.Tensor, forced: bool = False) -> bool:
    """Whether the fused launch takes this many tokens on this device: decode-sized steps up to the
    table's ``max_tokens``, or up to 16 when ``forced`` (the "triton" backend)."""
    cfg = kernel_config(TUNING_PACKAGE, "add_norm_route", "default", DEFAULTS, h.device)
    return h.dim() == 2 and h.shape[0] <= (16 if forced else cfg["max_tokens"])


def add_norm_route(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_shared: int = 1,
    zero_centered: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """r = h + residual; x = rms_norm(r) (· (1 + w) when zero-centred); logits = x @ router_weight.T;
    softmax top-k over the first E = rows - num_shared logits, the shared expert (id E, weight
    sigmoid(logit E)) appended when num_shared is 1.

    h, residual: [T, H] (unit last stride); norm_weight: [H]; router_weight: [E + S, H] (unit last
    stride). Returns (x [T, H], r [T, H], weights [T, k + S] fp32, ids [T, k + S] int32), or None
    when the ticket buffer would have to be made inside a CUDA-graph capture (call once eagerly first).
    """
    num_tokens, hidden = h.shape
    num_rows = router_weight.shape[0]
    if num_shared not in (0, 1) or residual.shape != h.shape or router_weight.shape[1] != hidden \
            or norm_weight.shape != (hidden,) or h.stride(1) != 1 or residual.stride(1) != 1 \
            or router_weight.stride(1) != 1:
        raise ValueError(f"add_norm_route: h {tuple(h.shape)}, residual {tuple(residual.shape)}, router "
                         f"{tuple(router_weight.shape)}, norm {tuple(norm_weight.shape)}, shared {num_shared} do not fit")
    tickets = ticket_buffer(h.device, num_tokens)
    if tickets is None:
        return None
    cfg = {**kernel_config(TUNING_PACKAGE, "add_norm_route", "default", DEFAULTS, h.device), **(config or {})}
    num_experts = num_rows - num_shared
    x = torch.empty_like(h)
    new_residual = torch.empty_like(h)
    logits = torch.empty(num_tokens, num_rows, dtype=torch.float32, device=h.device)
    weights = torch.empty(num_tokens, top_k + num_shared, dtype=torch.float32, device=h.device)
    ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int32, device=h.device)
    if num_tokens == 0:
        return x, new_residual, weights, ids
    _add_norm_route_kernel[(triton.cdiv(num_rows, cfg["BLOCK_N"]), num_tokens)](
        h, residual, norm_weight, router_weight, x, new_residual, logits, weights, ids, tickets,
        hidden, num_rows, num_experts, h.stride(0), residual.stride(0), router_weight.stride(0), float(eps),
        TOP_K=top_k, NUM_SHARED=num_shared, RENORMALIZE=renormalize, ZERO_CENTERED=zero_centered,
        BLOCK_H=triton.next_power_of_2(hidden), BLOCK_N=cfg["BLOCK_N"], BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k + num_shared), num_warps=cfg["num_warps"], **launch_options(h.device),
    )  # fmt: skip
    return x, new_residual, weights, ids
