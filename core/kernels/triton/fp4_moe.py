"""NVFP4 fused MoE: GEMV-style weight streaming for decode, a grouped tensor-core GEMM over expert-sorted rows for prefill.

Experts as ``armillary.kernels.fp4.fused_moe`` takes them: w13 uint8 [E, 2I or I, H / 2] (rows
[gate | up]), s13 e4m3 [E, 2I or I, H / 16], g13 fp32 [E, 2I or I]; w2 uint8 [E, H, I / 2], s2
[E, H, I / 16], g2 [E, H]. Weight-only: activations stay in x's dtype (h in fp32 on the GEMV path).

- GEMV (up to GEMV_MAX_PAIRS (token, expert) pairs; launch configs: the ``fp4_moe_gemv`` tuning entries, up
  and down kernels apart), fp8_moe's two launches with fp4_gemv's
  one-row unpacking: the up kernel, a program per (pair, BLOCK_N rows), streams the gate and up
  rows of its expert as int32 words (8 codes each, 16-byte loads), the group scale applied once
  per word, and stores act(gate · x) · (up · x) in fp32; the down kernel, a program per (token,
  BLOCK_N rows), walks the token's k experts and sums weight_j · (W2_e h_j) with each expert's
  row scales folded into its word sums, one reduction and one store: no atomics, no third launch.
- grouped (prefill): rows sorted by expert into BLOCK_M blocks (``moe_align``), each weight tile
  unpacked to x's dtype times its group scales (``fp4_gemv.dequant_halves``: low / high halves
  against the rows' even / odd columns) for ``tl.dot``, loads pipelined; the weighted sum over
  each token's k experts is core's one-pass ``sum_topk``. Rows per tile, each GEMM's weight tile
  (BLOCK_N x BLOCK_K), warps and stages come from the "fp4_moe_grouped" tuning entry (keyed as fp8_moe's grouped
  entry: experts, hidden, intermediate, top-k and rows per expert; ``bench/fp4_moe_grouped_sweep.py``
  measures it).
- dequant (prefill, where the bucket's ``fp4_moe_grouped`` entry says ``"variant": "dequant"``; the
  sweep writes it where this path beats the grouped kernel): every expert unpacked once into x's dtype
  (``fp4_gemv.dequantize``) and core's bf16 Triton MoE, which pays the unpacking once per call instead
  of once per row block, at the cost of a transient bf16 copy of all experts.

Reference: ``armillary.kernels.fp4.fused_moe``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.activation import act_and_mul, get_activation
from armillary.kernels import tuning
from armillary.kernels.triton.fp4_gemv import FOLD, as_words, dequant_halves, dequantize, word_products
from armillary.kernels.triton.fp8_moe import _FUSED_ACTS, _IDENTITY, _act, gemv_config_key, grouped_config_key
from armillary.kernels.triton.fp8_skinny import on_gpu, pdl_options
from armillary.kernels.triton import moe as bf16_moe
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.moe_align import moe_align
from armillary.kernels.triton.pdl import (expert_prefetch_args, expert_prefetch_chunk, pdl_prologue,
                                          prefetch_expert_chunk_l2)

GEMV_MAX_PAIRS = 64  # at most this many (token, expert) pairs take the GEMV path
VARIANTS = ("grouped", "dequant")  # the grouped entry's "variant": the NVFP4 tile kernel, or unpacked experts
TUNING_PACKAGE = "armillary.kernels"
GEMV_KERNEL = "fp4_moe_gemv"
# BLOCK_N1 / BLOCK_N2: weight rows per program (up: that many gate rows and as many up rows); BLOCK_K1 /
# BLOCK_K2: the K tile in weight columns (8 per int32 word), a power of two >= 16; the K loops are unrolled
GEMV_DEFAULTS = {"BLOCK_N1": 4, "BLOCK_K1": 2048, "num_warps1": 2, "BLOCK_N2": 8, "BLOCK_K2": 1024, "num_warps2": 4}
INTERPRETER_DEFAULTS = {**GEMV_DEFAULTS, "num_warps1": 4, "BLOCK_N2": 4}  # CPU: today's interpreter picks
GROUPED_KERNEL = "fp4_moe_grouped"
# keys per GEMM, suffix 1 up / 2 down: BLOCK_N weight rows and BLOCK_K columns per tile (a power of two >= 32: whole
# 16-column scale groups, >= 16 packed bytes), warps and stages; keyed by rows-per-expert bucket as fp8_moe's
_GROUPED_TILE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@triton.jit
def _rows_dot(w_e, s_e, x_row, rows, K, stride_wn, stride_sn, EVEN_K: tl.constexpr, K_TILES: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k W[rows, k] · x[k] · 2^-63 without the row global scale: fp32 [BLOCK_N, BLOCK_K / 8] word sums."""
    KW: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, KW)
    w_ptrs = w_e + rows[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
    s_ptrs = s_e + rows[:, None].to(tl.int64) * stride_sn + (offs_w // 2)[None, :]
    wide = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
    for kt in tl.static_range(K_TILES):
        k0 = kt * BLOCK_K
        if EVEN_K:
            w = tl.load(w_ptrs + k0 // 8, eviction_policy="evict_first")
            s = tl.load(s_ptrs + k0 // 16)
        else:
            w_ok = offs_w < (K - k0) // 8
            w = tl.load(w_ptrs + k0 // 8, mask=w_ok[None, :], other=0, eviction_policy="evict_first")
            s = tl.load(s_ptrs + k0 // 16, mask=w_ok[None, :], other=0.0)
        wide += word_products(w, x_row, k0, K, EVEN_K, KW) * s.to(tl.float32)
    return wide


@triton.jit
def _gemv_up_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, h_ptr, ids_ptr, I, K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_hm,
    A_DIV: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, K_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    w2_ptr, expert_stride_w13, expert_stride_w2, bytes_w13, bytes_w2, chunk_bytes, PREFETCH_EXPERTS: tl.constexpr,
):  # fmt: skip
    """Grid (pairs, cdiv(I, BN)): h[pair, n] = act(gate_n · x) · (up_n · x) (or act(up_n · x)) in fp32 with
    x = x[pair / A_DIV]; w_ptr int32 words [E, 2I or I, K / 8]. PREFETCH_EXPERTS: program (pair, c) also asks L2
    for chunk c (``chunk_bytes``) of w13[e] and of w2[e], which the later programs and the down kernel read."""
    pdl_prologue(PDL)
    pair, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if PREFETCH_EXPERTS:  # the first programs of each pair stream its expert's up and down weights into L2 in bulk
        prefetch_expert_chunk_l2(w_ptr, e, expert_stride_w13, bytes_w13, pid_n, chunk_bytes)
        prefetch_expert_chunk_l2(w2_ptr, e, expert_stride_w2, bytes_w2, pid_n, chunk_bytes)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % I  # clamped rows: unmasked wide loads, results not stored
    up_rows = rows + I if GATED else rows
    w_e, s_e, g_e = w_ptr + e * stride_we, s_ptr + e * stride_se, g_ptr + e * stride_ge
    x_row = x_ptr + (pair // A_DIV) * stride_xm
    up = tl.sum(_rows_dot(w_e, s_e, x_row, up_rows, K, stride_wn, stride_sn, EVEN_K, K_TILES, BLOCK_N, BLOCK_K),
                axis=1) * (tl.load(g_e + up_rows) * FOLD)  # [BN]
    if GATED:
        gate = tl.sum(_rows_dot(w_e, s_e, x_row, rows, K, stride_wn, stride_sn, EVEN_K, K_TILES, BLOCK_N, BLOCK_K),
                      axis=1) * (tl.load(g_e + rows) * FOLD)
        h = _act(gate, ACT) * up
    else:
        h = _act(up, ACT)
    tl.store(h_ptr + pair * stride_hm + offs_n, h, mask=offs_n < I)


@triton.jit
def _gemv_down_kernel(
    h_ptr, w_ptr, s_ptr, g_ptr, out_ptr, ids_ptr, topw_ptr, N, K,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_om,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(H, BN)): out[t, n] = Σ_j topk_w[t, j] · (w2[e_j] · h[t·k + j])_n, h fp32 [T·k, K]."""
    pdl_prologue(PDL)
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    KW: tl.constexpr = BLOCK_K // 8
    wide = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        row_scale = tl.load(g_ptr + e * stride_ge + rows) * tl.load(topw_ptr + pair)  # [BN]: global · routing weight
        part = _rows_dot(w_ptr + e * stride_we, s_ptr + e * stride_se, h_ptr + pair * stride_hm, rows, K, stride_wn,
                         stride_sn, EVEN_K, K_TILES, BLOCK_N, BLOCK_K)
        wide += part * row_scale[:, None]  # each expert's row scales inside: one reduction for all k experts
    total = tl.sum(wide, axis=1) * FOLD
    tl.store(out_ptr + t * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, s_ptr, g_ptr, out_ptr, sorted_ptr, block_expert_ptr, offsets_ptr, counts_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_om,
    A_DIV: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (max_blocks, cdiv(N, BN)): rows of expert-sorted block ``pid_m``; input row pair // A_DIV of a
    [rows, K] (x's dtype), output row = pair; w_ptr bytes [E, N, K / 2]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e) + tl.load(counts_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # padding rows read row 0
    src = pair // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    KB: tl.constexpr = BLOCK_K // 2
    offs_b = tl.arange(0, KB)
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :]  # [BM, BK]: wide async copies
    w_ptrs = w_ptr + e64 * stride_we + cols[:, None].to(tl.int64) * stride_wn + offs_b[None, :]  # [BN, KB]
    s_ptrs = s_ptr + e64 * stride_se + cols[:, None].to(tl.int64) * stride_sn + (offs_b // 8)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # W as the MMA's A operand, from registers
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
        else:
            b_ok = (offs_b < (K - k0) // 2)[None, :]
            a = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=b_ok, other=0)
            s = tl.load(s_ptrs, mask=b_ok, other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, KB, 2]))  # [BM, KB] each, in registers
        lo, hi = dequant_halves(b, s, a.dtype)  # [BN, KB]: weight columns 2c, 2c + 1
        acc = tl.dot(lo, tl.trans(a_even), acc, input_precision=DOT_PRECISION)  # [BN, BM]
        acc = tl.dot(hi, tl.trans(a_odd), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += KB
        s_ptrs += BLOCK_K // 16
    acc = acc * tl.load(g_ptr + e64 * stride_ge + cols)[:, None]
    dst = out_ptr + pair[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


def _gemv_meta(k: int, bn: int, width: int) -> dict:
    """Tile constexprs of a GEMV launch over K columns: tiles of ``width`` columns (a power of two, >= 16)."""
    bk = max(16, min(width, next_power_of_2(k)))
    tiles = cdiv(k, bk)
    return dict(EVEN_K=k % bk == 0, K_TILES=tiles, BLOCK_N=bn, BLOCK_K=bk)


def gemv_config(num_experts: int, hidden: int, inter: int, top_k: int, tokens: int, device: torch.device) -> dict:
    """Launch parameters of both GEMV kernels: GEMV_DEFAULTS (INTERPRETER_DEFAULTS off the GPU) under the
    ``fp4_moe_gemv`` entries (keys as fp8_moe's ``gemv_config_key``: tokens rounded up to a power of two)."""
    defaults = GEMV_DEFAULTS if on_gpu(device) else INTERPRETER_DEFAULTS
    return tuning.kernel_config(TUNING_PACKAGE, GEMV_KERNEL, gemv_config_key(num_experts, hidden, inter, top_k, tokens),
                                defaults, device if on_gpu(device) else None)


def gemv_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, topk_ids: torch.Tensor,
            h: torch.Tensor, activation: str | None, cfg: dict, w2: torch.Tensor | None = None) -> None:
    """h[p] (fp32, written) = act(gate_e x[p // k]) · up_e x[p // k] when ``activation`` is fused and h [P, I]
    of a gated w13 [E, 2I, H / 2]; else h [P, rows] = act(w13_e x) (``activation`` None: the rows as they
    are). s13 / g13 contiguous (g13 fp32), topk_ids [T, k] contiguous. ``w2``: the packed down weights
    [E, H, I / 2]; with them, where ``expert_prefetch_chunk`` allows, the first programs of each pair stream its
    expert's w13 and w2 slices into L2 in bulk."""
    k = topk_ids.shape[1]
    rows = h.shape[1]
    gated = activation is not None and w13.shape[1] == 2 * rows  # [gate | up] fused (unfused: h holds all rows)
    act = _FUSED_ACTS[activation] if activation is not None else _IDENTITY
    w = as_words(w13)  # [E, 2I or I, H / 8] int32
    bn = cfg["BLOCK_N1"]
    programs = cdiv(rows, bn)
    chunk = 0 if w2 is None else expert_prefetch_chunk(pdl_options(x.device, prefetch="experts")["PREFETCH"],
                                                        topk_ids.numel(), (w13, w2))
    w2 = w2 if w2 is not None else w13
    _gemv_up_kernel[(topk_ids.numel(), programs)](
        x, w, s13, g13, h, topk_ids, rows, x.shape[1], x.stride(0), w.stride(0), w.stride(1), s13.stride(0),
        s13.stride(1), g13.stride(0), h.stride(0), A_DIV=k, GATED=gated, ACT=act, num_warps=cfg["num_warps1"],
        num_stages=1, **_gemv_meta(x.shape[1], bn, cfg["BLOCK_K1"]), **pdl_options(x.device), w2_ptr=w2,
        **expert_prefetch_args(w13, w2, chunk))  # fmt: skip


def gemv_down(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, g2: torch.Tensor, topk_ids: torch.Tensor,
              weights: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    """out[t] (written) = Σ_j weights[t, j] · w2[ids[t, j]] · h[t · k + j]: h fp32 [T · k, I], topk_ids and
    weights (fp32) [T, k] contiguous, s2 / g2 (fp32) contiguous, out [T, H]."""
    t, k = topk_ids.shape
    hidden, inter = w2.shape[1], 2 * w2.shape[2]
    w = as_words(w2)  # [E, H, I / 8] int32
    bn = cfg["BLOCK_N2"]
    _gemv_down_kernel[(t, cdiv(hidden, bn))](
        h, w, s2, g2, out, topk_ids, weights, hidden, inter, h.stride(0), w.stride(0), w.stride(1), s2.stride(0),
        s2.stride(1), g2.stride(0), out.stride(0), TOP_K=k, num_warps=cfg["num_warps2"], num_stages=1,
        **_gemv_meta(inter, bn, cfg["BLOCK_K2"]), **pdl_options(out.device))  # fmt: skip


def _gemv_moe(x, w13, s13, g13, w2, s2, g2, topk_weights, topk_ids, activation: str,
              config: dict | None = None) -> torch.Tensor:
    """Decode: up kernel (GEMM 1, the activation fused when it is one of fp8_moe's), down kernel (GEMM 2 and
    the weighted sum); every chosen expert's packed weights streamed once. ``config`` overrides keys of the
    table's ``gemv_config`` (tests, sweeps)."""
    t, k = topk_ids.shape
    hidden, inter = w2.shape[1], 2 * w2.shape[2]
    cfg = {**gemv_config(w13.shape[0], hidden, inter, k, t, x.device), **(config or {})}
    gated = w13.shape[1] == 2 * inter
    fused = activation in _FUSED_ACTS
    ids = topk_ids.contiguous()
    up_rows = inter if fused else w13.shape[1]  # unfused: every w13 row through, the activation in torch
    s13, s2 = s13.contiguous(), s2.contiguous()
    g13, g2 = g13.float().contiguous(), g2.float().contiguous()
    h = torch.empty(t * k, up_rows, dtype=torch.float32, device=x.device)  # [P, I] (or [P, 2I] unfused)
    gemv_up(x, w13, s13, g13, ids, h, activation if fused else None, cfg, w2=w2)
    if not fused:
        h = act_and_mul(h, activation) if gated else get_activation(activation)(h)  # [P, I] fp32
        h = h.contiguous()
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.float().contiguous()  # [T, k]
    gemv_down(h, w2, s2, g2, ids, weights, out, cfg)
    return out


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor, a_div: int, num_pairs: int,
                  align, tile: dict) -> torch.Tensor:
    """Per-pair rows [pairs, N] of ``a[pair // a_div] @ W[e].T`` in a's dtype; ``tile``: BLOCK_N, BLOCK_K,
    num_warps, num_stages of this launch (BLOCK_M is the alignment's)."""
    _, n, half = w.shape
    k = 2 * half
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    bn, bk = tile["BLOCK_N"], tile["BLOCK_K"]
    _grouped_kernel[(align.block_expert.shape[0], cdiv(n, bn))](
        a, w, s, g, out, align.sorted_pair_ids, align.block_expert, align.expert_offsets, align.expert_counts,
        n, k, a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), g.stride(0), out.stride(0),
        A_DIV=a_div, EVEN_K=k % bk == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=align.block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )  # fmt: skip
    return out


def grouped_defaults(num_pairs: int, gpu: bool, block_m: int | None = None) -> dict:
    """The grouped launch without a table entry (the tiles before the table existed; variant "grouped"): ``block_m`` rows (None:
    64 on the GPU from 1024 pairs, else 16); 128 x 64 weight tiles, 8 warps for 64+ rows (else 4), 3 stages;
    the interpreter: 32 x 32 tiles, 4 warps, 1 stage."""
    bm = block_m or (64 if gpu and num_pairs >= 1024 else 16)
    tile = (128, 64, 8 if bm >= 64 else 4, 3) if gpu else (32, 32, 4, 1)
    return {"variant": "grouped", "BLOCK_M": bm, **{f"{key}{gemm}": value for gemm in (1, 2)
                                                    for key, value in zip(_GROUPED_TILE_KEYS, tile)}}


def grouped_config(num_experts: int, hidden: int, inter: int, top_k: int, num_pairs: int,
                   device: torch.device) -> dict:
    """Launch parameters of the grouped path: grouped_defaults under the ``fp4_moe_grouped`` entries (keys as
    fp8_moe's ``grouped_config_key``: average rows per expert rounded up to a bucket)."""
    gpu = on_gpu(device)
    key = grouped_config_key(num_experts, hidden, inter, top_k, num_pairs)
    return tuning.kernel_config(TUNING_PACKAGE, GROUPED_KERNEL, key, grouped_defaults(num_pairs, gpu),
                                device if gpu else None)


def _grouped_tiles(cfg: dict) -> tuple[dict, dict]:
    """The up and down GEMMs' launch keys out of a grouped config, checked (tl.dot / tl.arange: powers of two)."""
    bm = cfg["BLOCK_M"]
    tiles = tuple({key: cfg[f"{key}{gemm}"] for key in _GROUPED_TILE_KEYS} for gemm in (1, 2))
    bad = [t for t in tiles if t["BLOCK_N"] < 16 or t["BLOCK_N"] & (t["BLOCK_N"] - 1) or t["BLOCK_K"] < 32
           or t["BLOCK_K"] & (t["BLOCK_K"] - 1)]
    if bm < 16 or bm & (bm - 1) or bad:
        raise ValueError(f"fp4 grouped MoE: BLOCK_M and BLOCK_N must be powers of two >= 16, BLOCK_K >= 32, not "
                         f"BLOCK_M {bm}, up {tiles[0]}, down {tiles[1]}")
    return tiles


def fp4_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, w2: torch.Tensor,
                  s2: torch.Tensor, g2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", grouped: bool | str | None = None,
                  gemv: dict | None = None, tiles: dict | None = None) -> torch.Tensor:
    """``interfaces.Fp4FusedMoE``: x [T, H] (unit last stride) -> [T, H] in x's dtype; ``grouped`` forces a
    path (False: GEMV, True: the grouped kernel, "dequant": unpacked experts and the bf16 MoE; None: GEMV up to
    GEMV_MAX_PAIRS pairs, then the bucket's ``variant``);
    ``gemv`` / ``tiles`` override keys of the GEMV / grouped path's ``gemv_config`` / ``grouped_config``
    (tests, sweeps)."""
    t, k = topk_ids.shape
    e, rows13, half_h = w13.shape
    inter = 2 * w2.shape[2]
    if 2 * half_h != x.shape[1] or w2.shape[:2] != (e, x.shape[1]) or rows13 not in (inter, 2 * inter):
        raise ValueError(f"fp4_fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    for name, sc, gl, w in (("w13", s13, g13, w13), ("w2", s2, g2, w2)):
        if sc.dtype != torch.float8_e4m3fn or sc.shape != (*w.shape[:2], w.shape[2] // 8) or gl.shape != w.shape[:2]:
            raise ValueError(f"fp4_fused_moe: {name} scales {sc.dtype} {tuple(sc.shape)} / global {tuple(gl.shape)} "
                             f"do not fit the packed weight {tuple(w.shape)}")
    gated = rows13 == 2 * inter
    num_pairs = t * k
    if num_pairs == 0:
        return x.new_zeros(x.shape)
    x = x.contiguous()
    if not (num_pairs > GEMV_MAX_PAIRS if grouped is None else grouped):
        return _gemv_moe(x, w13, s13, g13, w2, s2, g2, topk_weights, topk_ids, activation, gemv)
    cfg = {**grouped_config(e, x.shape[1], inter, k, num_pairs, x.device), **(tiles or {})}
    if cfg["variant"] not in VARIANTS:
        raise ValueError(f"fp4 grouped MoE: variant must be one of {VARIANTS}, not {cfg['variant']!r}")
    if grouped == "dequant" or (grouped is None and cfg["variant"] == "dequant"):
        return bf16_moe.fused_moe(x, dequantize(w13, s13, g13, x.dtype), dequantize(w2, s2, g2, x.dtype),
                                  topk_weights, topk_ids, activation)
    up, down = _grouped_tiles(cfg)
    align = moe_align(topk_ids, e, cfg["BLOCK_M"])
    g13, g2 = g13.float().contiguous(), g2.float().contiguous()
    w13, w2, s13, s2 = w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous()
    h = _grouped_gemm(x, w13, s13, g13, k, num_pairs, align, up)  # [P, 2I] in x's dtype, as the reference
    h = act_and_mul(h, activation) if gated else get_activation(activation)(h)  # [P, I]
    y = _grouped_gemm(h.contiguous(), w2, s2, g2, 1, num_pairs, align, down)  # [P, H]
    return bf16_moe.sum_topk(y, k, torch.empty_like(x), topk_weights)  # Σ_j w_j · y_j in fp32, one pass
