"""GEMV-shaped MoE experts for a few tokens: stream whole weight rows, no MMA padding.

At one to a few tokens the MoE layer is a stream of the chosen experts' weights; the MMA kernels
(moe_decode) pad the few rows to 16 and read [BLOCK_K, BLOCK_N] tiles, BLOCK_N short K slices 4 KB
apart. Here every program reads BLOCK_N whole, contiguous weight rows and reduces along K on the
CUDA cores in float32:

- up: program (pair, n-tile) dots BLOCK_N rows of its expert's gate (and up) weights with
  x[token] and stores act(gate · x) (· up · x) into a float32 scratch h[pair, n-tile];
- down: program (token, n-tile) walks the token's k pairs, PAIR_BLOCK at a time, reads the rows
  w2[e, n-tile, :] and accumulates Σ_j weight_j · (W2_e h_j) in float32, then writes out[token,
  n-tile] once: the top-k sum is fused (no pairs buffer, no third kernel, no atomics, deterministic).

Weights are read once per (token, slot): right while tokens rarely share an expert (a fused shared
expert's repeats are concurrent and hit L2). Grids depend on shapes only, so both launches are
CUDA-graph capturable. With ``pdl`` the up kernel lets the down kernel launch early
(programmatic dependent launch): down programs fetch their first w2 tiles, which do not depend
on the up kernel, before ``gdc_wait`` and only then read h.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.moe_decode import _activation
from armillary.kernels.triton.pdl import pdl_available, pdl_override

try:  # programmatic dependent launch (Triton >= 3.3); only traced when a config asks for it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

# LOOP1 / LOOP2 keys: how the K loop is emitted
LOOP_STATIC = -1  # fully unrolled (tl.static_range): every tile's loads can be issued up front
LOOP_PLAIN = 0  # a plain loop; s > 0: tl.range(num_stages=s), loads pipelined through shared memory


@triton.jit
def _up_tile(x_ptrs, w_ptrs, up_step, k_left, acc, acc_up, offs_k, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """acc += W[BLOCK_N, BLOCK_K] * x[BLOCK_K] elementwise (acc_up likewise for the up rows)."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        if GATED:
            w_up = tl.load(w_ptrs + up_step, eviction_policy="evict_first")
        xv = tl.load(x_ptrs).to(tl.float32)
    else:
        k_ok = offs_k < k_left
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if GATED:
            w_up = tl.load(w_ptrs + up_step, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * xv[None, :]
    if GATED:
        acc_up += w_up.to(tl.float32) * xv[None, :]
    return acc, acc_up


@triton.jit
def moe_gemv_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    h_ptr,
    N,
    K,
    up_offset,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr,
    LOOP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[p, n] = act(W[e, n] · x[p // k]) (· W[e, up_offset + n] · x[p // k] when gated), e = ids[p].

    x: [T, K]; w: [E, (2)N, K]; ids: [T * k]; h: [T * k, N] float32. Grid (T * k, cdiv(N, BLOCK_N)).
    """
    if PDL:
        gdc_launch_dependents()  # the down kernel may take free SM slots and prefetch its weights
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = offs_n % N  # clamped rows keep the loads in bounds; their results are not stored
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + offs_k  # [BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + safe_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_step = up_offset * stride_wn
    # elementwise partial sums; one cross-thread reduction at the end instead of one per K tile
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if LOOP < 0:
        for kt in tl.static_range(K_TILES):
            acc, acc_up = _up_tile(x_ptrs + kt * BLOCK_K, w_ptrs + kt * BLOCK_K, up_step, K - kt * BLOCK_K,
                                   acc, acc_up, offs_k, EVEN_K, GATED)
    elif LOOP == 0:
        for kt in range(K_TILES):
            acc, acc_up = _up_tile(x_ptrs + kt * BLOCK_K, w_ptrs + kt * BLOCK_K, up_step, K - kt * BLOCK_K,
                                   acc, acc_up, offs_k, EVEN_K, GATED)
    else:
        for kt in tl.range(K_TILES, num_stages=LOOP):
            acc, acc_up = _up_tile(x_ptrs + kt * BLOCK_K, w_ptrs + kt * BLOCK_K, up_step, K - kt * BLOCK_K,
                                   acc, acc_up, offs_k, EVEN_K, GATED)
    h = _activation(tl.sum(acc, axis=1), ACTIVATION)  # [BLOCK_N]
    if GATED:
        h = h * tl.sum(acc_up, axis=1)
    tl.store(h_ptr + pair * stride_hm + offs_n, h, mask=offs_n < N)


@triton.jit
def _down_tile(w_ptrs, h_ptrs, k_left, slot_ok, scale, acc, offs_k, EVEN_K: tl.constexpr, PDL: tl.constexpr,
               FIRST: tl.constexpr):
    """acc += Σ_p W[p, BLOCK_N, BLOCK_K] * (scale[p] · h[p, BLOCK_K]) over the PAIR_BLOCK slots p."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=slot_ok[:, None, None], other=0.0, eviction_policy="evict_first")
    else:
        k_ok = offs_k < k_left
        w = tl.load(w_ptrs, mask=slot_ok[:, None, None] & k_ok[None, None, :], other=0.0,
                    eviction_policy="evict_first")
    if PDL:
        if FIRST:  # the first pair block: h is the up kernel's output, the weights above were fetched while it ran
            gdc_wait()
    if EVEN_K:
        h = tl.load(h_ptrs, mask=slot_ok[:, None], other=0.0)
    else:
        h = tl.load(h_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
    hs = h.to(tl.float32) * scale[:, None]  # [PAIR_BLOCK, BLOCK_K]: routing weight on the short vector
    acc += tl.sum(w.to(tl.float32) * hs[:, None, :], axis=0)
    return acc


@triton.jit
def moe_gemv_down_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    pair_weights_ptr,
    out_ptr,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr,
    LOOP: tl.constexpr,
    PAIR_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, n] = Σ_j weight[t, j] · (W2[ids[t, j], n] · h[t * k + j]), summed in float32.

    h: [T * k, K] float32; w: [E, N, K]; ids, pair_weights: [T * k]; out: [T, N].
    Grid (T, cdiv(N, BLOCK_N)).
    """
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, PAIR_BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for c in tl.static_range(0, TOP_K, PAIR_BLOCK):
        slot_ok = c + offs_p < TOP_K
        pairs = token * TOP_K + c + offs_p  # [PAIR_BLOCK]
        experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
        scale = tl.load(pair_weights_ptr + pairs, mask=slot_ok, other=0.0).to(tl.float32)
        w_ptrs = (w_ptr + experts[:, None, None] * stride_we + safe_n[None, :, None] * stride_wn
                  + offs_k[None, None, :])  # [PAIR_BLOCK, BLOCK_N, BLOCK_K]
        h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]  # [PAIR_BLOCK, BLOCK_K]
        if LOOP < 0:
            for kt in tl.static_range(K_TILES):
                acc = _down_tile(w_ptrs + kt * BLOCK_K, h_ptrs + kt * BLOCK_K, K - kt * BLOCK_K, slot_ok, scale, acc,
                                 offs_k, EVEN_K, PDL, c == 0)
        elif LOOP == 0:
            for kt in range(K_TILES):
                acc = _down_tile(w_ptrs + kt * BLOCK_K, h_ptrs + kt * BLOCK_K, K - kt * BLOCK_K, slot_ok, scale, acc,
                                 offs_k, EVEN_K, PDL, c == 0)
        else:
            for kt in tl.range(K_TILES, num_stages=LOOP):
                acc = _down_tile(w_ptrs + kt * BLOCK_K, h_ptrs + kt * BLOCK_K, K - kt * BLOCK_K, slot_ok, scale, acc,
                                 offs_k, EVEN_K, PDL, c == 0)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _pdl(cfg: dict, device: torch.device) -> bool:
    """Programmatic dependent launch: asked for (by its table row, unless ``ARMILLARY_PDL`` overrides) and
    available (the interpreter has no grids to chain)."""
    forced = pdl_override()
    return bool(cfg.get("pdl") if forced is None else forced) and pdl_available(device)


def gemv_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, gated: bool, activation: int,
            cfg: dict) -> None:
    """h[p] = act(gate_e x[p // k]) (· up_e x[p // k]) for every pair p = (token, slot).

    x: [T, H]; w13: [E, 2I or I, H]; ids: [T, k] contiguous; h: [T * k, I] float32 (written).
    """
    top_k = ids.shape[1]
    hidden, inter = x.shape[1], h.shape[1]
    bn, bk = cfg["BLOCK_N1"], min(cfg["BLOCK_K1"], next_power_of_2(hidden))
    moe_gemv_up_kernel[(ids.numel(), cdiv(inter, bn))](
        x, w13, ids, h, inter, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, GATED=gated, ACTIVATION=activation, EVEN_K=hidden % bk == 0, K_TILES=cdiv(hidden, bk),
        LOOP=cfg["LOOP1"], BLOCK_N=bn, BLOCK_K=bk, PDL=_pdl(cfg, x.device),
        num_warps=cfg["num_warps1"], num_stages=cfg["num_stages1"],
    )  # fmt: skip


def gemv_down(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, pair_weights: torch.Tensor, out: torch.Tensor,
              cfg: dict) -> None:
    """out[t] = Σ_j pair_weights[t, j] · down_e(h[t * k + j]), e = ids[t, j].

    h: [T * k, I] float32; w2: [E, H, I]; ids, pair_weights: [T, k] contiguous; out: [T, H] (written).
    """
    num_tokens, top_k = ids.shape
    hidden, inter = out.shape[1], h.shape[1]
    bn, bk = cfg["BLOCK_N2"], min(cfg["BLOCK_K2"], next_power_of_2(inter))
    pair_block = min(cfg["PAIR_BLOCK"], next_power_of_2(top_k))
    pdl = _pdl(cfg, out.device)
    moe_gemv_down_kernel[(num_tokens, cdiv(hidden, bn))](
        h, w2, ids, pair_weights, out, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, EVEN_K=inter % bk == 0, K_TILES=cdiv(inter, bk), LOOP=cfg["LOOP2"],
        PAIR_BLOCK=pair_block, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_weights: torch.Tensor, ids: torch.Tensor,
             out: torch.Tensor, gated: bool, activation: int, cfg: dict) -> torch.Tensor:
    """The whole MoE for a few tokens: out[t] = Σ_j w[t, j] · down_e(act(gate_e x[t]) · up_e x[t]).

    x: [T, H] (rows contiguous); w13: [E, 2I or I, H]; w2: [E, H, I]; pair_weights, ids: [T, k]
    contiguous; out: [T, H] (written). cfg: a "fused_moe_gemv" tuning entry.
    """
    h = torch.empty(ids.numel(), w2.shape[2], dtype=torch.float32, device=x.device)  # [T * k, I]
    gemv_up(x, w13, ids, h, gated, activation, cfg)
    gemv_down(h, w2, ids, pair_weights, out, cfg)
    return out
