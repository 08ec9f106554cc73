"""The MoE router of decode rows in one Triton launch: the float32 logits (``router.logits_tile``) and, in the
last program to finish, the sigmoid + correction-bias, group-limited top-k of core's ``topk_sigmoid_bias``.

The grid is ``router_logits``'s (expert blocks x row blocks, same block sizes: the same logit bits). Each
program stores its logits tile to a [T, E] float32 scratch, then takes a ticket (``acq_rel`` atomic add
on one of core's shared ``ticket_buffer`` counters, as core's split-K epilogue does); the last arriver
reads every row's logits back past L1 and routes all rows at once on [rows, E] tiles, then resets the
ticket to 0 so the next call (or a CUDA-graph replay) starts from zero. The routing is core's
``_route_kernel`` row by row written over a row axis: every argmax breaks ties to the lower index as
there (groups, then experts), so the ids equal the two-launch path's exactly, ties included. Returns
(weights [T, k + S] float32, ids [T, k + S] int32), S shared columns E.. with weight 1. Few rows only
(``MAX_ROWS``; the ``router_topk`` tuning entry's ``max_rows`` lowers it per GPU, 0 turning it off); the caller
keeps the pair for more. Grid and buffers follow host shapes: CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary_glm_flash.ops.router import logits_blocks, logits_tile, router_config

MAX_ROWS = 8  # decode-sized: the last program routes every row, so its [rows, E] tiles stay small
PACKAGE = "armillary_glm_flash"
KERNEL = "router_topk"
DEFAULTS = {"max_rows": MAX_ROWS}


def max_rows(device: torch.device) -> int:
    """Up to how many rows this GPU's tables send through the one launch (0: never; at most ``MAX_ROWS``)."""
    return min(MAX_ROWS, int(tuning.kernel_config(PACKAGE, KERNEL, "default", DEFAULTS, device)["max_rows"]))


@triton.jit
def route_rows(logits, bias_ptr, experts, in_range, num_experts, scaling, TOP_K: tl.constexpr,
               RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """logits [R, BLOCK_E] float32 -> (weights [R, BLOCK_K] float32, ids [R, BLOCK_K] int32) of the routed slots."""
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + experts, mask=in_range, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(in_range[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        # a group scores its two best choices; experts outside the TOPK_GROUP best groups are out
        group_size = num_experts // N_GROUP
        groups = tl.arange(0, BLOCK_G)
        member = (experts[None, :] // group_size == groups[:, None]) & in_range[None, :]  # [G, E]
        in_group = tl.where(member[None, :, :], choice[:, None, :], float("-inf"))  # [R, G, E]
        first = tl.max(in_group, axis=2)
        first_at = tl.argmax(in_group, axis=2)  # [R, G]
        second = tl.max(tl.where(experts[None, None, :] == first_at[:, :, None], float("-inf"), in_group), axis=2)
        group_score = tl.where(groups[None, :] < N_GROUP, first + second, float("-inf"))  # [R, G]
        kept = tl.zeros(group_score.shape, dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best_group = tl.argmax(group_score, axis=1)  # [R]
            hit = groups[None, :] == best_group[:, None]
            kept = tl.where(hit, 1, kept)
            group_score = tl.where(hit, float("-inf"), group_score)
        eligible = tl.max(tl.where(member[None, :, :], kept[:, :, None], 0), axis=1)  # [R, E]
        choice = tl.where(eligible > 0, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    picked_weights = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)  # [R]; ties go to the lower expert id, as core's route kernel
        is_best = experts[None, :] == best[:, None]
        best_score = tl.sum(tl.where(is_best, scores, 0.0), axis=1)
        picked_weights = tl.where(slots[None, :] == slot, best_score[:, None], picked_weights)
        picked_ids = tl.where(slots[None, :] == slot, best[:, None].to(tl.int32), picked_ids)
        choice = tl.where(is_best, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(picked_weights, axis=1) + 1e-20  # the DeepSeek-style routers' guard against an all-zero row
        picked_weights = picked_weights / total[:, None]
    return picked_weights * scaling, picked_ids


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, ticket_ptr, rows, E, K,
                        stride_xt, stride_we, scaling,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                        ALL_E: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                        RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_SLOTS: tl.constexpr, PDL: tl.constexpr):
    """Grid (expert blocks, row blocks): logits [T, E] float32 scratch; the last arriver writes weights / ids."""
    pdl_prologue(PDL)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    e_ok = offs_e < E
    t_ok = offs_t < rows
    acc = logits_tile(x_ptr, w_ptr, offs_t, offs_e, t_ok, e_ok, K, stride_xt, stride_we, BLOCK_T, BLOCK_E, BLOCK_K)
    tl.store(logits_ptr + offs_t[:, None] * E + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits are written before the ticket releases them
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last arriver routes every row
        experts = tl.arange(0, ALL_E)
        in_range = experts < E
        row = tl.arange(0, ROWS)
        row_ok = row < rows
        logits = tl.load(logits_ptr + row[:, None] * E + experts[None, :], mask=row_ok[:, None] & in_range[None, :],
                         other=float("-inf"), cache_modifier=".cg")  # [ROWS, ALL_E]; as core's route kernel pads
        picked_weights, picked_ids = route_rows(logits, bias_ptr, experts, in_range, E, scaling, TOP_K, RENORMALIZE,
                                                N_GROUP, TOPK_GROUP, BLOCK_G, BLOCK_SLOTS)
        slots = tl.arange(0, BLOCK_SLOTS)
        width = TOP_K + NUM_SHARED
        if NUM_SHARED > 0:  # shared experts E.. behind the routed ones, weight 1 (not scaled)
            is_shared = ((slots >= TOP_K) & (slots < width))[None, :]
            picked_weights = tl.where(is_shared, 1.0, picked_weights)
            picked_ids = tl.where(is_shared, E + slots[None, :] - TOP_K, picked_ids)
        out_mask = row_ok[:, None] & (slots < width)[None, :]
        out = row[:, None] * width + slots[None, :]
        tl.store(weights_ptr + out, picked_weights, mask=out_mask)
        tl.store(ids_ptr + out, picked_ids, mask=out_mask)
        tl.store(ticket_ptr, 0)  # no other program of this call touches the ticket any more


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                scaling: float = 1.0, num_shared: int = 0, n_group: int = 1, topk_group: int = 1,
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (unit last stride, T <= ``MAX_ROWS``), weight [E, H] float32, bias [E] float32 (both contiguous)
    -> (weights [T, k + S] float32, ids [T, k + S] int32), as ``router_logits`` then ``ops.sigmoid_topk``."""
    rows, k = x.shape
    experts = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or not weight.is_contiguous() or weight.dtype != torch.float32:
        raise ValueError(f"router_topk: x {tuple(x.shape)} / weight {tuple(weight.shape)} {weight.dtype} do not fit")
    if bias.shape != (experts,) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"router_topk: the correction bias must be [{experts}] float32, contiguous")
    if rows > MAX_ROWS:
        raise ValueError(f"router_topk: {rows} rows, at most {MAX_ROWS} (more take router_logits + sigmoid_topk)")
    if not 0 < top_k <= experts:
        raise ValueError(f"router_topk: top_k {top_k} must be in 1..{experts}")
    if n_group > 1 and (experts % n_group or experts // n_group < 2 or not 0 < topk_group <= n_group):
        raise ValueError(f"router_topk: {experts} experts need n_group {n_group} groups of >= 2 and "
                         f"1 <= topk_group <= n_group")
    width = top_k + num_shared
    weights = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, width, dtype=torch.int32, device=x.device)
    if rows == 0:
        return weights, ids
    cfg = dict(router_config(experts, k, rows, x.device) if config is None else config)
    block_t, block_e, block_k = logits_blocks(cfg, rows, k)
    logits = torch.empty(rows, experts, dtype=torch.float32, device=x.device)  # the programs' hand-over
    grid = (cdiv(experts, block_e), cdiv(rows, block_t))
    _router_topk_kernel[grid](
        x, weight, bias, logits, weights, ids, ticket_buffer(x.device, 1), rows, experts, k, x.stride(0),
        weight.stride(0), float(scaling), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
        ROWS=next_power_of_2(rows), ALL_E=next_power_of_2(experts), TOP_K=top_k,
        NUM_SHARED=num_shared, RENORMALIZE=renormalize, N_GROUP=n_group, TOPK_GROUP=topk_group,
        BLOCK_G=next_power_of_2(n_group), BLOCK_SLOTS=next_power_of_2(width),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x.device))
    return weights, ids
