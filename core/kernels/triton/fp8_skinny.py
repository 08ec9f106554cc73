"""Skinny FP8 GEMM for decode (up to 64 rows): one pass over the fp8 weight in wide contiguous loads, dequantized in registers.

``y = x @ (W · S).T``: W float8_e4m3fn [N, K], S fp32 [ceil(N / bn), ceil(K / bk)] (per-channel: bn 1,
bk >= K), x unquantized (W8A16, what ``armillary.kernels.fp8.linear`` computes). The cost is
streaming W once, so the layout follows core's bf16 skinny GEMM (skinny_gemm.py, measured at
~3.7 TB/s on an H200): each program owns BLOCK_N rows of W and all of K (or one split of it),
and shapes with few row tiles split K until there are about two programs per SM.

- one row (``fma``): the tile is [BLOCK_N, NSUB, SUB_K] with SUB_K the weight's K block, so a
  thread reads 16 contiguous fp8 bytes per load, the block scale multiplies the short x vector
  (NSUB scales per tile, never per element), products accumulate per lane in fp32 and are
  reduced once at the end;
- 2-64 rows (``dot``): [BLOCK_N, SUB_K] fp8 tiles widened to x's dtype (exact) against x on the
  tensor cores, loads pipelined through shared memory, the tile's fp32 product times its block
  scale.

Split K is deterministic and needs no second launch: the last program of a tile (a ticket from
``device_buffers.ticket_buffer``) sums the fp32 partials in split order, adds the bias and stores,
as skinny_gemm does. CUDA-graph capturable; PDL as the other decode kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.triton.skinny_gemm import _sm_count
from armillary.kernels.triton.split_k import split_k_epilogue

DECODE_MAX_ROWS = 64  # up to this many rows stream W with unquantized activations
FMA_BLOCK_K = 512  # fp8 bytes per weight row per tile: 16 per thread in 32-thread rows
DOT_BLOCK_K = 128
OFFLINE_SM_COUNT: int | None = None  # set by bench/fp8_compile_check.py: pick GPU configs with no GPU


def on_gpu(device: torch.device) -> bool:
    """Whether launches are configured for a GPU (a CUDA device, or the offline compile check)."""
    return OFFLINE_SM_COUNT is not None or device.type == "cuda"


def sm_count(device: torch.device) -> int:
    return OFFLINE_SM_COUNT or _sm_count(device)


def pdl_options(device: torch.device) -> dict:
    """``launch_options`` (programmatic dependent launch on sm_90+), on in the offline compile check."""
    return {"PDL": True, "launch_pdl": True} if OFFLINE_SM_COUNT is not None else launch_options(device)


@triton.jit
def fp8_row_products(w_ptr, s_ptr, x, rows, row_blk, k0, K, stride_wn, stride_sn, stride_sk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr,
                     ROWS_SHARE: tl.constexpr, NSUB: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr):
    """W[rows, k0 : k0 + NSUB·SUB_K] · x elementwise, fp32 [BN, NSUB, SUB_K], times the block scales when
    they vary along K (K_SCALED; else the caller scales each row's sum). x: [NSUB, SUB_K] fp32.
    ROWS_SHARE: all rows lie in scale row ``row_blk`` (NSUB scales per tile); else one per row and sub-tile."""
    sub = tl.arange(0, NSUB)
    koff = k0 + sub[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]  # [NSUB, SUB_K]
    ptrs = w_ptr + rows[:, None, None].to(tl.int64) * stride_wn + koff[None, :, :]
    if EVEN_K:
        w = tl.load(ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(ptrs, mask=(koff < K)[None, :, :], other=0.0, eviction_policy="evict_first")
    wf = w.to(tl.float32)
    if K_SCALED:
        kcol = tl.minimum(k0 + sub * SUB_K, K - 1) // GROUP_K  # [NSUB]; clamped: a tile past K is all zeros
        if ROWS_SHARE:
            s = tl.load(s_ptr + row_blk * stride_sn + kcol * stride_sk)  # [NSUB]
            return wf * (x * s[:, None])[None, :, :]
        s = tl.load(s_ptr + (rows // GROUP_N)[:, None] * stride_sn + kcol[None, :] * stride_sk)  # [BN, NSUB]
        return wf * x[None, :, :] * s[:, :, None]
    return wf * x[None, :, :]


@triton.jit
def fp8_row_scales(s_ptr, rows, stride_sn, GROUP_N: tl.constexpr):
    """The scale of each row when one scale column covers all of K (per-channel / bk >= K): [BN]."""
    return tl.load(s_ptr + (rows // GROUP_N) * stride_sn)


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_skinny_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_sn, stride_sk, split_k,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr, ROWS_SHARE: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
    SUB_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (N tiles, M tiles, split_k): program (n, m, s) computes out tile (m, n) over K tiles
    [s · K_TILES, (s + 1) · K_TILES) of NSUB · SUB_K columns. part_ptr: [split_k, M, N] fp32;
    ticket_ptr: [M tiles · N tiles] int32, zero between calls. EVEN_K: no K masks needed."""
    pdl_prologue(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    rows = offs_n % N  # clamped rows keep the weight loads unmasked (wide); their sums are not stored
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    k_lo = pid_k * (K_TILES * NSUB * SUB_K)
    if USE_DOT:  # NSUB == 1
        offs_k = tl.arange(0, SUB_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, SUB_K]
        x_ptrs = x_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, SUB_K]
        for kt in range(K_TILES):
            k0 = k_lo + kt * SUB_K
            if EVEN_K:
                w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
                x = tl.load(x_ptrs + k0)
            else:
                k_ok = offs_k < K - k0
                w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
            part = tl.dot(w.to(x.dtype), tl.trans(x), input_precision=DOT_PRECISION)  # [BN, BM] fp32
            if K_SCALED:
                kcol = tl.minimum(k0, K - 1) // GROUP_K  # clamped: a tile past K multiplies zeros
                if ROWS_SHARE:
                    acc += part * tl.load(s_ptr + row_blk * stride_sn + kcol * stride_sk)
                else:
                    s = tl.load(s_ptr + (rows // GROUP_N) * stride_sn + kcol * stride_sk)
                    acc += part * s[:, None]
            else:
                acc += part
    else:  # one row
        sub = tl.arange(0, NSUB)
        kk = tl.arange(0, SUB_K)
        wide = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        for kt in tl.static_range(K_TILES):
            k0 = k_lo + kt * NSUB * SUB_K
            koff = k0 + sub[:, None] * SUB_K + kk[None, :]  # [NSUB, SUB_K]
            if EVEN_K:
                x = tl.load(x_row + koff).to(tl.float32)
            else:
                x = tl.load(x_row + koff, mask=koff < K, other=0.0).to(tl.float32)
            wide += fp8_row_products(w_ptr, s_ptr, x, rows, row_blk, k0, K, stride_wn, stride_sn, stride_sk,
                                     GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, NSUB, SUB_K, EVEN_K)
        acc = tl.sum(tl.sum(wide, axis=2), axis=1)[:, None]  # [BN, 1]
    if not K_SCALED:
        acc = acc * fp8_row_scales(s_ptr, rows, stride_sn, GROUP_N)[:, None]

    split_k_epilogue(acc, out_ptr, bias_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok, M, N, stride_om,
                     pid_n, pid_m, pid_k, split_k, HAS_BIAS, BLOCK_N, BLOCK_M)


def k_layout(k: int, block_k: int, width: int) -> tuple[int, int, bool]:
    """(NSUB, SUB_K, K_SCALED) of a tile about ``width`` columns wide: SUB_K never straddles two weight
    scale columns (it is the weight's K block when the scale varies along K)."""
    bk = min(width, max(16, triton.next_power_of_2(k)))
    scaled = block_k < k
    if not scaled:
        return 1, bk, False
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"fp8 kernels take power-of-two weight blocks of at least 16 along K, not {block_k}")
    sub = min(block_k, bk)
    return bk // sub, sub, True


def decode_config(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device) -> dict:
    """Path, tiles and split-K of one decode call: at least two programs per SM where K allows (each split keeps >= 4 x 512 or 8 x 128 columns)."""
    use_dot = m > 1
    nsub, sub_k, scaled = k_layout(k, block_k, DOT_BLOCK_K if use_dot else FMA_BLOCK_K)
    if use_dot:
        nsub, bm, bn = 1, max(16, triton.next_power_of_2(m)), 32 if m <= 16 else 64
    else:
        bm, bn = 1, 16
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    k_blocks = triton.cdiv(k, nsub * sub_k)
    want, split = 2 * sm_count(device), 1
    per_split = 8 if use_dot else 4  # K tiles a split keeps at least: dot tiles are 4x narrower
    while tiles * split < want and split * per_split <= k_blocks:  # 144 tiles on 132 SMs: a near-empty 2nd wave
        split *= 2
    k_tiles = triton.cdiv(k_blocks, split)
    return dict(USE_DOT=use_dot, BLOCK_M=bm, BLOCK_N=bn, NSUB=nsub, SUB_K=sub_k, K_SCALED=scaled,
                K_TILES=k_tiles, split_k=triton.cdiv(k_blocks, k_tiles), num_warps=4,
                num_stages=4 if use_dot and on_gpu(device) else 1)


def fp8_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                    bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride), weight fp8 [N, K], scale fp32 [ceil(N / bn), ceil(K / bk)] (checked
    by the caller) -> [M, N] in x's dtype. ``config`` overrides keys of ``decode_config`` (tests, sweeps)."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = {**decode_config(m, n, k, block_n, block_k, x.device), **(config or {})}
    if cfg["USE_DOT"] != (cfg["BLOCK_M"] > 1) or (cfg["USE_DOT"] and cfg["NSUB"] != 1):
        raise ValueError(f"fp8_skinny_gemm: inconsistent config {cfg}")
    width = cfg["NSUB"] * cfg["SUB_K"]
    split = cfg["split_k"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
    tickets = ticket_buffer(x.device, tiles)  # untouched without a split
    part = torch.empty(split if split > 1 else 1, m, n if split > 1 else 1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    _fp8_skinny_kernel[grid](
        x, weight, scale, bias if bias is not None else out, out, part, tickets,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), scale.stride(0),
        scale.stride(1) if scale.shape[1] > 1 else 0, split,
        GROUP_N=block_n, GROUP_K=block_k if cfg["K_SCALED"] else 1 << 30, K_SCALED=cfg["K_SCALED"],
        ROWS_SHARE=block_n % cfg["BLOCK_N"] == 0, HAS_BIAS=bias is not None, USE_DOT=cfg["USE_DOT"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=k % (width * cfg["K_TILES"]) == 0, K_TILES=cfg["K_TILES"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], NSUB=cfg["NSUB"], SUB_K=cfg["SUB_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(x.device),
    )  # fmt: skip
    return out
