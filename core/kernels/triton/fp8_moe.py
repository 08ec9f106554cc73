"""FP8 fused MoE: GEMV-style weight streaming for decode; for prefill the grouped block-scaled GEMMs (fp8_moe_grouped) or the unpacked experts.

Weights are float8_e4m3fn [E, N, K] with fp32 block scales [E, ceil(N / bn), ceil(K / bk)].

- GEMV (decode, up to GEMV_MAX_PAIRS (token, expert) pairs), two launches as core's bf16 MoE GEMV
  (moe_gemv.py, ~3 TB/s on an H200): the up kernel, a program per (pair, BLOCK_N rows), reads the
  gate and up rows of its expert whole in [BLOCK_N, NSUB, SUB_K] tiles (16-byte loads, SUB_K the
  weight's K block, one scale per sub-tile applied to x) and stores act(gate · x) · (up · x) in
  fp32; the down kernel, a program per (token, BLOCK_N rows), walks the token's k experts and
  sums weight_j · (W2_e h_j) in fp32 before one store: no atomics, no third launch. Activations
  other than silu / relu² / gelu-tanh: the same streaming for each GEMM, the activation in torch.
  Rows per program, tile width, warps and stages come from the "fp8_moe_gemv" tuning entry (keyed by
  experts, hidden, intermediate, top-k and tokens; ``bench/fp8_moe_gemv_sweep.py`` measures it).
- grouped (prefill, fp8_moe_grouped.py): rows sorted by expert into BLOCK_M blocks (``moe_align``); x is
  quantized once per row and 128-column group (``fp8_gemm.quantize_act``, one launch), and the tiles
  multiply on the fp8 tensor cores with ``acc += dot · a_scale · w_scale`` per K step. The up GEMM stores h
  in x's dtype and the activation (and gate · up) runs inside the down GEMM's quantization launch. The
  weighted sum over each token's k experts is core's one-pass ``sum_topk``. Tiles come from the
  "fp8_moe_grouped" tuning entry (``grouped_config``; ``bench/fp8_moe_grouped_sweep.py`` measures it).
- dequant (prefill, where the bucket's entry says ``"variant": "dequant"``, which the sweep writes where
  it beats the grouped kernel): every expert unpacked once into x's dtype (``fp8_gemm.dequantize_blocks``)
  and core's bf16 Triton MoE, weight-only (activations unquantized), at the cost of a transient bf16 copy
  of all experts.

Reference: ``armillary.kernels.fp8.fused_moe`` (``quantize_input=True`` for the grouped path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.activation import act_and_mul, get_activation
from armillary.kernels.triton.fp8_gemm import act_group, dequantize_blocks, quantize_act
from armillary.kernels.triton.fp8_moe_grouped import (  # noqa: F401 (re-exported: the grouped path's names)
    GROUPED_BUCKETS, GROUPED_KERNEL, TUNING_PACKAGE, VARIANTS, _grouped_gemm, _grouped_kernel, grouped_block_m,
    grouped_config, grouped_config_key, grouped_defaults, grouped_tile, use_tma)
from armillary.kernels.triton.fp8_skinny import (WIDE_FOLD, fp8_row_products, fp8_row_scales, fp8_x_tile, k_layout,
                                                 on_gpu, pdl_options)
from armillary.kernels.triton import moe as bf16_moe
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.moe_align import moe_align
from armillary.kernels.triton.fp8_moe_down import gemv_down_pairs
from armillary.kernels.triton.pdl import (expert_prefetch_args, expert_prefetch_chunk, pdl_launch_dependents,
                                          pdl_prologue, pdl_wait, prefetch_expert_chunk_l2)

GEMV_MAX_PAIRS = 64  # at most this many (token, expert) pairs take the GEMV path
GEMV_KERNEL = "fp8_moe_gemv"
# BLOCK_N1 / BLOCK_N2: weight rows per program (up: that many gate rows and as many up rows); BLOCK_K1 /
# BLOCK_K2: the tile's columns (NSUB · SUB_K, SUB_K at most the weight's K block), powers of two >= 16.
# num_stages1 > 1: the up kernel's K tiles in a pipelined loop instead of unrolled (the down kernel's
# loops stay unrolled: num_stages2 is only the launch option). down_preload (optional): fp8_moe_down's kernel.
GEMV_DEFAULTS = {"BLOCK_N1": 2, "BLOCK_K1": 1024, "num_warps1": 2, "num_stages1": 1,
                 "BLOCK_N2": 4, "BLOCK_K2": 512, "num_warps2": 4, "num_stages2": 1}
INTERPRETER_DEFAULTS = {**GEMV_DEFAULTS, "BLOCK_N1": 4, "num_warps1": 4}  # CPU: fewer, larger programs
_FUSED_ACTS = {"silu": 0, "swish": 0, "relu2": 1, "gelu_pytorch_tanh": 2, "gelu_tanh": 2}
_IDENTITY = 3


@triton.jit
def _act(x, ACT: tl.constexpr):
    """The expert activation in fp32: 0 silu, 1 relu², 2 gelu (tanh), 3 none."""
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        r = tl.maximum(x, 0.0)
        return r * r
    elif ACT == 2:
        return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x)) - 1.0))
    else:
        return x


@triton.jit
def _up_tile(x_row, w_e, s_e, rows, up_rows, gate_blk, up_blk, k0, K, stride_wn, stride_sn, stride_sk, acc_u, acc_g,
             GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr, ROWS_SHARE: tl.constexpr,
             GATED: tl.constexpr, EVEN_K: tl.constexpr, NSUB: tl.constexpr, SUB_K: tl.constexpr):
    """One [BN, NSUB, SUB_K] tile at column k0 of the up (and gate) rows, added to the elementwise sums."""
    koff = k0 + tl.arange(0, NSUB)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]  # [NSUB, SUB_K]
    x = fp8_x_tile(x_row, koff, K, EVEN_K)
    acc_u += fp8_row_products(w_e, s_e, x, up_rows, up_blk, k0, K, stride_wn, stride_sn, stride_sk,
                              GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, NSUB, SUB_K, EVEN_K)
    if GATED:
        acc_g += fp8_row_products(w_e, s_e, x, rows, gate_blk, k0, K, stride_wn, stride_sn, stride_sk,
                                  GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, NSUB, SUB_K, EVEN_K)
    return acc_u, acc_g


@triton.jit
def _gemv_up_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, I, K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hm,
    A_DIV: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr,
    ROWS_SHARE: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr, STAGES: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr, SUB_K: tl.constexpr,
    PDL: tl.constexpr, w2_ptr, expert_stride_w13, expert_stride_w2, bytes_w13, bytes_w2, chunk_bytes,
    PREFETCH_EXPERTS: tl.constexpr, LATE_TRIGGER: tl.constexpr,
):  # fmt: skip
    """Grid (pairs, cdiv(I, BN)): h[pair, n] = act(gate_n · x) · (up_n · x) (or act(up_n · x)) in fp32,
    x = x[pair / A_DIV]; the gate row n and up row I + n of w13[e] streamed by one program. STAGES 1: the
    K tiles unrolled; s > 1: a loop software-pipelined over s stages. PREFETCH_EXPERTS: program (pair, c) also
    asks L2 for chunk c (``chunk_bytes``) of w13[e] and of w2[e], which the later programs and the down kernel read.
    LATE_TRIGGER: the down kernel may launch only once every program has waited (routing finished), so it can
    read the routing before its own wait."""
    if LATE_TRIGGER:
        pdl_wait(PDL)
        pdl_launch_dependents(PDL)
    else:
        pdl_prologue(PDL)
    pair, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if PREFETCH_EXPERTS:  # the first programs of each pair stream its expert's up and down weights into L2 in bulk
        prefetch_expert_chunk_l2(w_ptr, e, expert_stride_w13, bytes_w13, pid_n, chunk_bytes)
        prefetch_expert_chunk_l2(w2_ptr, e, expert_stride_w2, bytes_w2, pid_n, chunk_bytes)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % I  # clamped rows: unmasked wide loads, results not stored
    up_rows = rows + I if GATED else rows
    gate_blk = (pid_n * BLOCK_N) // GROUP_N
    up_blk = ((I if GATED else 0) + pid_n * BLOCK_N) // GROUP_N
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    x_row = x_ptr + (pair // A_DIV) * stride_xm
    acc_u = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
    if STAGES > 1:
        for kt in tl.range(K_TILES, num_stages=STAGES):
            acc_u, acc_g = _up_tile(x_row, w_e, s_e, rows, up_rows, gate_blk, up_blk, kt * NSUB * SUB_K, K,
                                    stride_wn, stride_sn, stride_sk, acc_u, acc_g, GROUP_N, GROUP_K, K_SCALED,
                                    ROWS_SHARE, GATED, EVEN_K, NSUB, SUB_K)
    else:
        for kt in tl.static_range(K_TILES):
            acc_u, acc_g = _up_tile(x_row, w_e, s_e, rows, up_rows, gate_blk, up_blk, kt * NSUB * SUB_K, K,
                                    stride_wn, stride_sn, stride_sk, acc_u, acc_g, GROUP_N, GROUP_K, K_SCALED,
                                    ROWS_SHARE, GATED, EVEN_K, NSUB, SUB_K)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1) * WIDE_FOLD  # [BN]
    if not K_SCALED:
        up = up * fp8_row_scales(s_e, up_rows, stride_sn, GROUP_N)
    if GATED:
        gate = tl.sum(tl.sum(acc_g, axis=2), axis=1) * WIDE_FOLD
        if not K_SCALED:
            gate = gate * fp8_row_scales(s_e, rows, stride_sn, GROUP_N)
        h = _act(gate, ACT) * up
    else:
        h = _act(up, ACT)
    tl.store(h_ptr + pair * stride_hm + offs_n, h, mask=offs_n < I)


@triton.jit
def _gemv_down_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, topw_ptr, N, K,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om,
    TOP_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr,
    ROWS_SHARE: tl.constexpr, EVEN_K: tl.constexpr, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
    NSUB: tl.constexpr, SUB_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(H, BN)): out[t, n] = Σ_j topk_w[t, j] · (w2[e_j] · h[t·k + j])_n: GEMM 2 and the
    weighted sum over the token's experts in one launch, no atomics; h fp32 [T·k, K]."""
    pdl_prologue(PDL)
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    sub = tl.arange(0, NSUB)
    kk = tl.arange(0, SUB_K)
    wide = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(topw_ptr + pair)
        w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
        part = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
        for kt in tl.static_range(K_TILES):
            k0 = kt * NSUB * SUB_K
            koff = k0 + sub[:, None] * SUB_K + kk[None, :]  # [NSUB, SUB_K]
            x = fp8_x_tile(h_ptr + pair * stride_hm, koff, K, EVEN_K)  # h is fp32 already
            part += fp8_row_products(w_e, s_e, x * weight, rows, row_blk, k0, K, stride_wn, stride_sn, stride_sk,
                                     GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, NSUB, SUB_K, EVEN_K)
        if K_SCALED:
            wide += part  # the scales are inside: one reduction for all k experts
        else:
            total += tl.sum(tl.sum(part, axis=2), axis=1) * WIDE_FOLD * fp8_row_scales(s_e, rows, stride_sn, GROUP_N)
    if K_SCALED:
        total = tl.sum(tl.sum(wide, axis=2), axis=1) * WIDE_FOLD
    tl.store(out_ptr + t * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _gemv_meta(k: int, block_n: int, block_k: int, bn: int, width: int) -> dict:
    """Tile constexprs of a GEMV launch over K columns (ROWS_SHARE decided by the caller's row offsets)."""
    if bn < 1 or bn & (bn - 1) or width < 16 or width & (width - 1):
        raise ValueError(f"fp8 MoE GEMV: rows per program ({bn}) and tile width ({width}) must be powers of two, "
                         "the width at least 16")
    nsub, sub_k, scaled = k_layout(k, block_k, width)
    tiles = cdiv(k, nsub * sub_k)
    return dict(GROUP_N=block_n, GROUP_K=block_k if scaled else 1 << 30, K_SCALED=scaled,
                EVEN_K=k % (nsub * sub_k) == 0, K_TILES=tiles, BLOCK_N=bn, NSUB=nsub, SUB_K=sub_k)


def gemv_config_key(num_experts: int, hidden: int, inter: int, top_k: int, tokens: int) -> str:
    """Tuning key: the expert shape, (token, expert) slots per token and tokens rounded up to a power of two."""
    return f"e{num_experts}_h{hidden}_i{inter}_k{top_k}_t{next_power_of_2(max(tokens, 1))}"


def gemv_config(num_experts: int, hidden: int, inter: int, top_k: int, tokens: int, device: torch.device) -> dict:
    """Launch parameters of both GEMV kernels: GEMV_DEFAULTS (INTERPRETER_DEFAULTS off the GPU) under the tables."""
    defaults = GEMV_DEFAULTS if on_gpu(device) else INTERPRETER_DEFAULTS
    return tuning.kernel_config(TUNING_PACKAGE, GEMV_KERNEL, gemv_config_key(num_experts, hidden, inter, top_k, tokens),
                                defaults, device)


def gemv_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, block_n: int, block_k: int,
            topk_ids: torch.Tensor, h: torch.Tensor, activation: str | None, cfg: dict,
            w2: torch.Tensor | None = None, late_trigger: bool = False) -> None:
    """h[p] (fp32, written) = act(gate_e x[p // k]) · up_e x[p // k] when ``activation`` is fused and h [P, I]
    of a gated w13 [E, 2I, H]; else h [P, rows] = act(w13_e x) (``activation`` None: the rows as they are).
    topk_ids [T, k] contiguous. ``w2``: the down weights [E, H, I]; with them, where ``expert_prefetch_chunk``
    allows, the first programs of each pair stream its expert's w13 and w2 slices into L2 in bulk.
    ``late_trigger``: the next kernel launches only after every program's PDL wait (``fp8_moe_down``)."""
    k = topk_ids.shape[1]
    rows = h.shape[1]
    gated = activation is not None and w13.shape[1] == 2 * rows  # [gate | up] fused (unfused: h holds all rows)
    act = _FUSED_ACTS[activation] if activation is not None else _IDENTITY
    bn = cfg["BLOCK_N1"]
    meta = _gemv_meta(w13.shape[2], block_n, block_k, bn, cfg["BLOCK_K1"])
    share = block_n % bn == 0 and (not gated or rows % bn == 0)  # every tile inside one scale row block
    programs = cdiv(rows, bn)
    chunk = 0 if w2 is None else expert_prefetch_chunk(pdl_options(x.device, prefetch="experts")["PREFETCH"],
                                                        topk_ids.numel(), (w13, w2))
    w2 = w2 if w2 is not None else w13
    _gemv_up_kernel[(topk_ids.numel(), programs)](
        x, w13, s13, h, topk_ids, rows, w13.shape[2], x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), s13.stride(2) if s13.shape[2] > 1 else 0, h.stride(0), A_DIV=k, ROWS_SHARE=share,
        GATED=gated, ACT=act, STAGES=cfg["num_stages1"], num_warps=cfg["num_warps1"],
        num_stages=cfg["num_stages1"], **meta, **pdl_options(x.device), w2_ptr=w2, LATE_TRIGGER=late_trigger,
        **expert_prefetch_args(w13, w2, chunk))  # fmt: skip


def gemv_down(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, block_n: int, block_k: int,
              topk_ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    """out[t] (written) = Σ_j weights[t, j] · w2[ids[t, j]] · h[t · k + j]: h fp32 [T · k, I], topk_ids and
    weights (fp32) [T, k] contiguous, out [T, H]."""
    t, k = topk_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    bn = cfg["BLOCK_N2"]
    meta = _gemv_meta(inter, block_n, block_k, bn, cfg["BLOCK_K2"])
    _gemv_down_kernel[(t, cdiv(hidden, bn))](
        h, w2, s2, out, topk_ids, weights, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), s2.stride(2) if s2.shape[2] > 1 else 0, out.stride(0), TOP_K=k,
        ROWS_SHARE=block_n % bn == 0, num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], **meta,
        **pdl_options(out.device))  # fmt: skip


def _gemv_moe(x, w13, s13, w2, s2, block_n, block_k, topk_weights, topk_ids, activation: str,
              config: dict | None = None) -> torch.Tensor:
    """Decode: up kernel (GEMM 1, the activation fused when it is one of _FUSED_ACTS), down kernel (GEMM 2
    and the weighted sum); every chosen expert's weights streamed once, in wide contiguous loads.
    ``config`` overrides keys of the table's ``gemv_config`` (tests, sweeps)."""
    t, k = topk_ids.shape
    inter, hidden = w2.shape[2], w2.shape[1]
    cfg = {**gemv_config(w13.shape[0], hidden, inter, k, t, x.device), **(config or {})}
    fused = activation in _FUSED_ACTS
    ids = topk_ids.contiguous()
    up_rows = inter if fused else w13.shape[1]  # unfused: every w13 row through, the activation in torch
    h = torch.empty(t * k, up_rows, dtype=torch.float32, device=x.device)  # [P, I] (or [P, 2I] unfused)
    # down_preload: the down kernel split over pairs, its weights read before its PDL wait (the whole I in a tile)
    down_meta = _gemv_meta(inter, block_n, block_k, cfg["BLOCK_N2"], cfg["BLOCK_K2"]) \
        if cfg.get("down_preload", False) else None
    pairs = down_meta is not None and down_meta["K_TILES"] == 1
    gemv_up(x, w13, s13, block_n, block_k, ids, h, activation if fused else None, cfg, w2=w2, late_trigger=pairs)
    if not fused:
        gated = w13.shape[1] == 2 * inter
        h = act_and_mul(h, activation) if gated else get_activation(activation)(h)  # [P, I] fp32
        h = h.contiguous()
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.float().contiguous()  # [T, k]
    if pairs:
        gemv_down_pairs(h, w2, s2, ids, weights, out, down_meta, cfg["BLOCK_N2"], cfg["num_warps2"])
    else:
        gemv_down(h, w2, s2, block_n, block_k, ids, weights, out, cfg)
    return out


def fp8_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block_n: int, block_k: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", grouped: bool | str | None = None, block_m: int | None = None,
                  gemv: dict | None = None, tiles: dict | None = None) -> torch.Tensor:
    """x [T, H] (unit last stride) -> [T, H] in x's dtype; ``grouped`` forces a path (False: GEMV, True: the
    grouped kernel, "dequant": unpacked experts and the bf16 MoE; None: GEMV up to GEMV_MAX_PAIRS pairs, then
    the bucket's ``variant``),
    ``block_m`` the grouped path's rows per tile with today's tiles for it, no table (None: the table's
    ``grouped_config``); ``gemv`` / ``tiles`` override keys of the GEMV / grouped path's config (tests, sweeps)."""
    t, k = topk_ids.shape
    inter = w2.shape[2]
    gated = w13.shape[1] == 2 * inter
    num_pairs = t * k
    if num_pairs == 0:
        return x.new_zeros(x.shape)
    x = x.contiguous()
    if not (num_pairs > GEMV_MAX_PAIRS if grouped is None else grouped):
        return _gemv_moe(x, w13, s13, w2, s2, block_n, block_k, topk_weights, topk_ids, activation, gemv)
    if block_m is None:
        cfg = grouped_config(w13.shape[0], x.shape[1], inter, k, num_pairs, x.device)
    else:
        cfg = grouped_defaults(num_pairs, on_gpu(x.device), block_m)
    cfg.update(tiles or {})
    if cfg["variant"] not in VARIANTS:
        raise ValueError(f"fp8 grouped MoE: variant must be one of {VARIANTS}, not {cfg['variant']!r}")
    if grouped == "dequant" or (grouped is None and cfg["variant"] == "dequant"):
        return bf16_moe.fused_moe(x, dequantize_blocks(w13, s13, block_n, block_k, x.dtype),
                                  dequantize_blocks(w2, s2, block_n, block_k, x.dtype), topk_weights, topk_ids,
                                  activation)
    if cfg["BLOCK_M"] < 16 or cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1):
        raise ValueError(f"fp8 grouped MoE: BLOCK_M must be a power of two >= 16, not {cfg['BLOCK_M']}")
    up, down = grouped_tile(cfg, 1), grouped_tile(cfg, 2)
    align = moe_align(topk_ids, w13.shape[0], cfg["BLOCK_M"])
    # per-pair rows in the model dtype, rounded where the reference's F.linear outputs are
    xq, xs = quantize_act(x, act_group(x.shape[1], block_k))  # one launch: e4m3 rows, scales [groups, T]
    h = _grouped_gemm(xq, xs, w13, s13, block_n, block_k, k, num_pairs, align, x.dtype, up)  # [P, 2I]
    if activation in _FUSED_ACTS:  # the activation (and gate · up) inside the quantization launch
        hq, hs = quantize_act(h, act_group(inter, block_k), activation=_FUSED_ACTS[activation], gated=gated)
    else:
        hq, hs = quantize_act((act_and_mul(h, activation) if gated else get_activation(activation)(h)).contiguous(),
                              act_group(inter, block_k))  # [P, I]
    y = _grouped_gemm(hq, hs, w2, s2, block_n, block_k, 1, num_pairs, align, x.dtype, down)  # [P, H]
    return bf16_moe.sum_topk(y, k, torch.empty_like(x), topk_weights)  # Σ_j w_j · y_j in fp32, one pass
