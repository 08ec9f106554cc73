"""The fp8 MoE GEMV's down kernel split over the token's experts, its weights loaded before the PDL wait.

``fp8_moe``'s down kernel walks a token's k experts inside one program, so it can read nothing before
the PDL wait: its expert ids come from the routing kernel. Split over the (token, expert) pairs, a
program (n tile, token, j) streams one expert's [BLOCK_N, I] rows, and it may load them (and its id,
routing weight and block scales) before its wait when the up kernel between the two lets its
dependents launch only after its own wait (``late_trigger``): the routing kernel has then finished.
The k partial tiles are summed in pair order by the last arriver (``split_k_epilogue``: deterministic,
tickets back at zero), so batch 1 pays a boundary of loads already in registers instead of a cold one.

Reference: ``armillary.kernels.fp8.fused_moe``; the walk kernel's sums are the same up to fp32 order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.fp8_skinny import (WIDE_FOLD, fp8_row_scales, fp8_tile_products, fp8_w_tile,
                                                 fp8_x_tile, pdl_options)
from armillary.kernels.triton.host import cdiv
from armillary.kernels.triton.pdl import pdl_launch_dependents, pdl_wait
from armillary.kernels.triton.split_k import split_k_epilogue


@triton.jit(do_not_specialize=["T"])  # T = 1 would become a constexpr int, which split_k_epilogue cannot widen
def _gemv_down_pairs_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, topw_ptr, part_ptr, ticket_ptr, T, N, K,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om,
    TOP_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr,
    ROWS_SHARE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
    SUB_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BN), T, TOP_K): program (n, t, j) adds topw[t, j] · (w2[ids[t, j]] · h[t·k + j]) over its
    BN rows; the whole K (= NSUB · SUB_K) in one tile. h fp32 [T·k, K]; part_ptr [TOP_K, T, N] fp32; ticket_ptr
    [T · N tiles] int32, zero between calls. The id, routing weight and weight tile are read before the PDL wait:
    launch it only behind a kernel that triggers its dependents after its own wait (``gemv_up``'s late_trigger)."""
    pdl_launch_dependents(PDL)
    pid_n, t, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N  # clamped rows: unmasked wide loads, results not stored
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    pair = t.to(tl.int64) * TOP_K + j
    # the routing kernel (two launches back) has finished: its ids and the static weights now, h after the wait
    e = tl.load(ids_ptr + pair).to(tl.int64)
    weight = tl.load(topw_ptr + pair)
    w = fp8_w_tile(w_ptr + e * stride_we, rows, 0, K, stride_wn, NSUB, SUB_K, EVEN_K)
    pdl_wait(PDL)
    s_e = s_ptr + e * stride_se
    koff = tl.arange(0, NSUB)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]  # [NSUB, SUB_K]
    x = fp8_x_tile(h_ptr + pair * stride_hm, koff, K, EVEN_K) * weight  # h is fp32 already
    prod = fp8_tile_products(w, s_e, x, rows, row_blk, 0, K, stride_sn, stride_sk, GROUP_N, GROUP_K, K_SCALED,
                             ROWS_SHARE, NSUB, SUB_K)
    acc = tl.sum(tl.sum(prod, axis=2), axis=1) * WIDE_FOLD  # [BN]
    if not K_SCALED:
        acc = acc * fp8_row_scales(s_e, rows, stride_sn, GROUP_N)
    split_k_epilogue(acc[:, None], out_ptr, out_ptr, part_ptr, ticket_ptr, offs_n, t + tl.arange(0, 1),
                     offs_n < N, tl.arange(0, 1) < 1, T, N, stride_om, pid_n, t, j, TOP_K, False, BLOCK_N, 1)


def gemv_down_pairs(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, topk_ids: torch.Tensor,
                    weights: torch.Tensor, out: torch.Tensor, meta: dict, bn: int, num_warps: int) -> None:
    """out[t] (written) = Σ_j weights[t, j] · w2[ids[t, j]] · h[t · k + j], the pairs split over programs.
    h fp32 [T · k, I]; topk_ids, weights (fp32) [T, k] contiguous; out [T, H]; ``meta``: ``fp8_moe._gemv_meta``
    of one K tile (K_TILES 1). Only behind an up kernel launched with ``late_trigger``."""
    t, k = topk_ids.shape
    hidden = w2.shape[1]
    if meta["K_TILES"] != 1:
        raise ValueError(f"fp8 MoE down over pairs: the intermediate size {w2.shape[2]} must fit one tile "
                         f"(BLOCK_K2 >= {w2.shape[2]})")
    tiles = cdiv(hidden, bn)
    part = torch.empty(k, t, hidden, dtype=torch.float32, device=h.device)  # [k, T, H] partials
    tickets = ticket_buffer(h.device, tiles * t)
    _gemv_down_pairs_kernel[(tiles, t, k)](
        h, w2, s2, out, topk_ids, weights, part, tickets, t, hidden, w2.shape[2], h.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), s2.stride(2) if s2.shape[2] > 1 else 0, out.stride(0), TOP_K=k,
        ROWS_SHARE=meta["GROUP_N"] % bn == 0, GROUP_N=meta["GROUP_N"], GROUP_K=meta["GROUP_K"],
        K_SCALED=meta["K_SCALED"], EVEN_K=meta["EVEN_K"], BLOCK_N=bn, NSUB=meta["NSUB"], SUB_K=meta["SUB_K"],
        num_warps=num_warps, num_stages=1, **pdl_options(out.device))  # fmt: skip
