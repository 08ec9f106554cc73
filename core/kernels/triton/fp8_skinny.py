"""Skinny FP8 GEMM for decode (up to 64 rows): one pass over the fp8 weight in wide contiguous loads, dequantized in registers.

``y = x @ (W · S).T``: W float8_e4m3fn [N, K], S fp32 [ceil(N / bn), ceil(K / bk)] (per-channel: bn 1,
bk >= K), x unquantized (W8A16, what ``armillary.kernels.fp8.linear`` computes). The cost is
streaming W once, so the layout follows core's bf16 skinny GEMM (skinny_gemm.py, measured at
~3.7 TB/s on an H200): each program owns BLOCK_N rows of W and all of K (or one split of it),
and shapes with few row tiles split K until there are about two programs per SM.

- one row (``fma``): the tile is [BLOCK_N, NSUB, SUB_K] with SUB_K the weight's K block, so a
  thread reads 16 contiguous fp8 bytes per load, the block scale multiplies the short x vector
  (NSUB scales per tile, never per element), products accumulate per lane in fp32 and are
  reduced once at the end; the bytes are widened to fp32 by ``e4m3_to_f32_folded`` (three integer
  ops a value, no conversion instruction; the fused MoE's GEMV shares ``fp8_row_products``);
- 2-64 rows (``dot``): [BLOCK_N, SUB_K] fp8 tiles widened to x's dtype (exact) against x on the
  tensor cores, loads pipelined through shared memory, the tile's fp32 product times its block
  scale. Widening to bf16 is ``e4m3_to_bf16``: integer moves and one bf16x2 multiply per two
  values. Triton's own cast on sm_90 goes e4m3 -> f16 -> bf16, 1.5 conversions per value on the
  conversion unit (16 a clock per SM): by that count ~7.5 us for the 19 M values of a 9216 x 2048
  weight, more than streaming its bytes takes (4.5 us at 4.2 TB/s), while the scale loads are one
  per tile. The estimate is why the first version ran at 550-900 GB/s; ``bench/fp8_bench.py
  --phase kernels`` times both widenings (``fast_bf16``) against bf16 cuBLAS.

Split K is deterministic and needs no second launch: the last program of a tile (a ticket from
``device_buffers.ticket_buffer``) sums the fp32 partials in split order, adds the bias and stores,
as skinny_gemm does. CUDA-graph capturable; PDL as the other decode kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_launch_dependents, pdl_wait, prefetch_rows_l2
from armillary.kernels.triton.skinny_gemm import _sm_count
from armillary.kernels.triton.split_k import split_k_epilogue

DECODE_MAX_ROWS = 64  # up to this many rows stream W with unquantized activations
TWO_POW_120 = tl.constexpr(2.0 ** 120)  # e4m3_to_bf16_scaled's multiplier fold
WIDE_FOLD = tl.constexpr(2.0 ** 60)  # e4m3_to_f32_folded's 2^-120, paid back half on x, half on the sums
TUNING_PACKAGE = "armillary.kernels"
KERNEL = "fp8_skinny"
# BLOCK_K: fp8 bytes per weight row per one-row tile (16 per thread in 32-thread rows); DOT_BLOCK_N 0:
# 32 up to 16 rows, 64 above; DOT_BLOCK_K: columns per multi-row tile (at most the weight's K block);
# split_k 0: enough splits for target_waves programs per SM, each keeping >= (dot_)min_split_cols
# columns of K; fast_bf16: the integer e4m3 -> bf16 widening (False: Triton's cast, for comparison);
# dot_unroll: the multi-row tiles as straight-line code instead of a pipelined loop (num_stages unused);
# dot_scale_w: block scales (rounded to bf16 for bf16 x) on the widened weight tiles, not on each tile's product;
# preload (optional key, one row): a program's whole weight tile loaded into registers before the PDL wait.
DEFAULTS = {
    "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "DOT_BLOCK_N": 0, "DOT_BLOCK_K": 128, "dot_num_warps": 4,
    "dot_num_stages": 4, "split_k": 0, "target_waves": 2, "min_split_cols": 1024, "dot_min_split_cols": 512,
    "fast_bf16": True, "dot_unroll": False, "dot_scale_w": False,
}  # fmt: skip
OFFLINE_SM_COUNT: int | None = None  # set by bench/fp8_compile_check.py: pick GPU configs with no GPU


def on_gpu(device: torch.device) -> bool:
    """Whether launches are configured for a GPU (a CUDA device, or the offline compile check)."""
    return OFFLINE_SM_COUNT is not None or device.type == "cuda"


def sm_count(device: torch.device) -> int:
    return OFFLINE_SM_COUNT or _sm_count(device)


def pdl_options(device: torch.device, prefetch: str | None = None) -> dict:
    """``launch_options`` (programmatic dependent launch on sm_90+; ``prefetch``: the kernel's ``PREFETCH`` of
    that kind too), all on in the offline compile check."""
    if OFFLINE_SM_COUNT is not None:
        return {"PDL": True, "launch_pdl": True, **({"PREFETCH": True} if prefetch else {})}
    return launch_options(device, prefetch)


# e4m3 -> bf16 by integer moves, four bytes of $2 into the bf16x2 lanes of $0 and $1 (each exponent 120 too low),
# then one bf16x2 multiply of each by {mul}: 2^120 (e4m3_to_bf16) or bf16(scale · 2^120) (e4m3_to_bf16_scaled)
_WIDEN_ASM = """
        {{
        .reg .b32 a<2>, b<2>, e120;
        mov.u32 e120, 0x7B807B80;
        prmt.b32 a0, 0, $2, 0x5140;
        prmt.b32 a1, 0, $2, 0x7362;
        lop3.b32 b0, a0, 0x7fff7fff, 0, 0xc0;
        lop3.b32 b1, a1, 0x7fff7fff, 0, 0xc0;
        shr.b32 b0, b0, 4;
        shr.b32 b1, b1, 4;
        lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
        mul.rn.bf16x2 $0, b0, {mul};
        mul.rn.bf16x2 $1, b1, {mul};
        }}
        """
WIDEN_ASM = tl.constexpr(_WIDEN_ASM.format(mul="e120"))
WIDEN_SCALED_ASM = tl.constexpr(_WIDEN_ASM.format(mul="$3"))


@triton.jit
def e4m3_to_bf16(w):
    """float8e4nv -> bfloat16, exact, four values per 32-bit word: each byte moved to the top of a 16-bit
    lane, exponent and mantissa shifted into bf16's fields (the e4m3 exponent lands 120 too low, the
    sign stays), then one bf16x2 multiply by 2^120 (which also makes e4m3 subnormals normal)."""
    return tl.inline_asm_elementwise(asm=WIDEN_ASM, constraints="=r,=r,r", args=[w.to(tl.uint8, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def e4m3_to_bf16_scaled(w, scale):
    """float8e4nv ``q`` -> bfloat16 ``q · bf16(scale)`` rounded once (the product is exact in fp32, so this
    equals that product rounded to bf16): ``e4m3_to_bf16``'s integer moves, then one bf16x2 multiply by
    bf16(scale · 2^120) instead of 2^120. ``scale``: fp32 scalar, below 2^8 (a block's amax < 114688)."""
    folded = (scale * TWO_POW_120).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    pair = tl.broadcast_to(folded | (folded << 16), w.shape)  # the bf16x2 multiplier in every lane
    return tl.inline_asm_elementwise(asm=WIDEN_SCALED_ASM, constraints="=r,=r,r,r,r,r,r",
                                     args=[w.to(tl.uint8, bitcast=True), pair], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def bf16_rounded(v):
    """fp32 ``v`` rounded to the nearest bfloat16 (ties to even), kept in fp32; finite values only."""
    bits = v.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32_folded(w):
    """float8e4nv -> fp32 ``q · 2^-120``, exact, in three integer ops a value: the byte to the top of a word,
    an arithmetic shift by 4 (exponent and mantissa into fp32's fields, the sign smeared over bits 31-27),
    a mask keeping bit 31 and bits 26-20. e4m3 subnormals become fp32 subnormals (these kernels do not flush
    them). Triton's cast takes two conversions a value (e4m3 -> f16 -> f32) on the slower conversion unit."""
    v = (w.to(tl.uint8, bitcast=True).to(tl.uint32) << 24).to(tl.int32, bitcast=True) >> 4
    return (v & -2014314496).to(tl.float32, bitcast=True)  # 0x87F00000


@triton.jit
def fp8_x_tile(x_row, koff, K, EVEN_K: tl.constexpr):
    """x at columns ``koff`` ([NSUB, SUB_K]) widened to fp32, zeros past K unless EVEN_K."""
    if EVEN_K:
        x = tl.load(x_row + koff).to(tl.float32)
    else:
        x = tl.load(x_row + koff, mask=koff < K, other=0.0).to(tl.float32)
    return x


@triton.jit
def fp8_row_products(w_ptr, s_ptr, x, rows, row_blk, k0, K, stride_wn, stride_sn, stride_sk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr,
                     ROWS_SHARE: tl.constexpr, NSUB: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr):
    """W[rows, k0 : k0 + NSUB·SUB_K] · x elementwise times 2^-60 (the caller multiplies each sum by
    ``WIDE_FOLD``), fp32 [BN, NSUB, SUB_K], times the block scales when they vary along K (K_SCALED; else
    the caller scales each row's sum). x: [NSUB, SUB_K] fp32. ROWS_SHARE: all rows lie in scale row
    ``row_blk`` (NSUB scales per tile); else one per row and sub-tile. Every product rounds as
    ``q · (x · s)`` would (the powers of two are exact) unless it falls below 2^-66."""
    w = fp8_w_tile(w_ptr, rows, k0, K, stride_wn, NSUB, SUB_K, EVEN_K)
    return fp8_tile_products(w, s_ptr, x, rows, row_blk, k0, K, stride_sn, stride_sk, GROUP_N, GROUP_K, K_SCALED,
                             ROWS_SHARE, NSUB, SUB_K)


@triton.jit
def fp8_w_tile(w_ptr, rows, k0, K, stride_wn, NSUB: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The fp8 weight tile W[rows, k0 : k0 + NSUB·SUB_K] as [BN, NSUB, SUB_K] (zeros past K unless EVEN_K)."""
    koff = k0 + tl.arange(0, NSUB)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]  # [NSUB, SUB_K]
    ptrs = w_ptr + rows[:, None, None].to(tl.int64) * stride_wn + koff[None, :, :]
    if EVEN_K:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs, mask=(koff < K)[None, :, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def fp8_tile_products(w, s_ptr, x, rows, row_blk, k0, K, stride_sn, stride_sk, GROUP_N: tl.constexpr,
                      GROUP_K: tl.constexpr, K_SCALED: tl.constexpr, ROWS_SHARE: tl.constexpr, NSUB: tl.constexpr,
                      SUB_K: tl.constexpr):
    """``fp8_row_products`` of an already loaded tile ``w`` [BN, NSUB, SUB_K] (``fp8_w_tile``'s)."""
    sub = tl.arange(0, NSUB)
    wf = e4m3_to_f32_folded(w)  # q · 2^-120
    xf = x * WIDE_FOLD  # 2^60 here, 2^60 on the caller's sums
    if K_SCALED:
        kcol = tl.minimum(k0 + sub * SUB_K, K - 1) // GROUP_K  # [NSUB]; clamped: a tile past K is all zeros
        if ROWS_SHARE:
            s = tl.load(s_ptr + row_blk * stride_sn + kcol * stride_sk)  # [NSUB]
            return wf * (xf * s[:, None])[None, :, :]
        s = tl.load(s_ptr + (rows // GROUP_N)[:, None] * stride_sn + kcol[None, :] * stride_sk)  # [BN, NSUB]
        return wf * xf[None, :, :] * s[:, :, None]
    return wf * xf[None, :, :]


@triton.jit
def fp8_row_scales(s_ptr, rows, stride_sn, GROUP_N: tl.constexpr):
    """The scale of each row when one scale column covers all of K (per-channel / bk >= K): [BN]."""
    return tl.load(s_ptr + (rows // GROUP_N) * stride_sn)


@triton.jit
def _dot_tile(acc, w_ptrs, x_ptrs, s_ptr, rows, row_blk, k0, K, offs_k, stride_sn, stride_sk,
              GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr, ROWS_SHARE: tl.constexpr,
              EVEN_K: tl.constexpr, FAST_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_W: tl.constexpr):
    """acc [BN, BM] += W[rows, k0 : k0 + SUB_K] · x[:, same]^T times the tile's block scale. SCALE_W (block
    scales shared by the tile's rows): the scale multiplies the widened weights, rounded to x's dtype."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0)
    else:
        k_ok = offs_k < K - k0
        w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
    kcol = tl.minimum(k0, K - 1) // GROUP_K  # the tile's scale column; clamped: a tile past K multiplies zeros
    if SCALE_W:  # the block scale on the widened tile: the dots chain on one accumulator, no wait per tile
        s = tl.load(s_ptr + row_blk * stride_sn + kcol * stride_sk)
        if FAST_BF16:
            wd = e4m3_to_bf16_scaled(w, s)
        elif x.dtype == tl.bfloat16:  # the PTX's rounding (q · bf16(s) is exact in fp32); an fp32 dot of the same
            # values: the interpreter's bf16 dot is wrong and its casts truncate (Triton 3.9)
            wd = bf16_rounded(w.to(tl.float32) * bf16_rounded(s))
            return tl.dot(wd, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            wd = (w.to(x.dtype) * s).to(x.dtype)
        return tl.dot(wd, tl.trans(x), acc, input_precision=DOT_PRECISION)
    wd = e4m3_to_bf16(w) if FAST_BF16 else w.to(x.dtype)  # exact either way
    part = tl.dot(wd, tl.trans(x), input_precision=DOT_PRECISION)  # [BN, BM] fp32
    if K_SCALED:
        if ROWS_SHARE:
            return acc + part * tl.load(s_ptr + row_blk * stride_sn + kcol * stride_sk)
        s = tl.load(s_ptr + (rows // GROUP_N) * stride_sn + kcol * stride_sk)
        return acc + part * s[:, None]
    return acc + part


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_skinny_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_sn, stride_sk, split_k,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, K_SCALED: tl.constexpr, ROWS_SHARE: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
    SUB_K: tl.constexpr, FAST_BF16: tl.constexpr, UNROLL: tl.constexpr, SCALE_W: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """Grid (N tiles, M tiles, split_k): program (n, m, s) computes out tile (m, n) over K tiles
    [s · K_TILES, (s + 1) · K_TILES) of NSUB · SUB_K columns. part_ptr: [split_k, M, N] fp32;
    ticket_ptr: [M tiles · N tiles] int32, zero between calls. EVEN_K: no K masks needed. FAST_BF16: bf16 x
    on a GPU (``e4m3_to_bf16`` is inline PTX: the interpreter takes Triton's cast)."""
    pdl_launch_dependents(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    rows = offs_n % N  # clamped rows keep the weight loads unmasked (wide); their sums are not stored
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    k_lo = pid_k * (K_TILES * NSUB * SUB_K)
    if PREFETCH:  # the weights are not the previous kernel's: ask for them before waiting
        prefetch_rows_l2(w_ptr, rows, stride_wn, k_lo, tl.minimum(k_lo + K_TILES * NSUB * SUB_K, K), NSUB * SUB_K)
    if PRELOAD:  # one row, K_TILES 1: the program's whole weight tile in registers while the previous kernel ends
        w_pre = fp8_w_tile(w_ptr, rows, k_lo, K, stride_wn, NSUB, SUB_K, EVEN_K)
    pdl_wait(PDL)
    if USE_DOT:  # NSUB == 1: one scale per tile
        offs_k = tl.arange(0, SUB_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, SUB_K]
        x_ptrs = x_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, SUB_K]
        if UNROLL:  # straight-line tiles: the compiler may issue later tiles' loads before the first dot
            for kt in tl.static_range(K_TILES):
                acc = _dot_tile(acc, w_ptrs, x_ptrs, s_ptr, rows, row_blk, k_lo + kt * SUB_K, K, offs_k, stride_sn,
                                stride_sk, GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, EVEN_K, FAST_BF16, DOT_PRECISION,
                                SCALE_W)
        else:  # a loop the software pipeliner stages through shared memory (num_stages)
            for kt in range(K_TILES):
                acc = _dot_tile(acc, w_ptrs, x_ptrs, s_ptr, rows, row_blk, k_lo + kt * SUB_K, K, offs_k, stride_sn,
                                stride_sk, GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, EVEN_K, FAST_BF16, DOT_PRECISION,
                                SCALE_W)
    else:  # one row
        sub = tl.arange(0, NSUB)
        kk = tl.arange(0, SUB_K)
        wide = tl.zeros([BLOCK_N, NSUB, SUB_K], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        if PRELOAD:
            x = fp8_x_tile(x_row, k_lo + sub[:, None] * SUB_K + kk[None, :], K, EVEN_K)
            wide = fp8_tile_products(w_pre, s_ptr, x, rows, row_blk, k_lo, K, stride_sn, stride_sk, GROUP_N, GROUP_K,
                                     K_SCALED, ROWS_SHARE, NSUB, SUB_K)
        else:
            for kt in tl.static_range(K_TILES):
                k0 = k_lo + kt * NSUB * SUB_K
                koff = k0 + sub[:, None] * SUB_K + kk[None, :]  # [NSUB, SUB_K]
                x = fp8_x_tile(x_row, koff, K, EVEN_K)
                wide += fp8_row_products(w_ptr, s_ptr, x, rows, row_blk, k0, K, stride_wn, stride_sn, stride_sk,
                                         GROUP_N, GROUP_K, K_SCALED, ROWS_SHARE, NSUB, SUB_K, EVEN_K)
        acc = tl.sum(tl.sum(wide, axis=2), axis=1)[:, None] * WIDE_FOLD  # [BN, 1]
    if not K_SCALED:
        acc = acc * fp8_row_scales(s_ptr, rows, stride_sn, GROUP_N)[:, None]

    split_k_epilogue(acc, out_ptr, bias_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok, M, N, stride_om,
                     pid_n, pid_m, pid_k, split_k, HAS_BIAS, BLOCK_N, BLOCK_M)


def k_layout(k: int, block_k: int, width: int) -> tuple[int, int, bool]:
    """(NSUB, SUB_K, K_SCALED) of a tile about ``width`` columns wide: SUB_K never straddles two weight
    scale columns (it is the weight's K block when the scale varies along K)."""
    bk = min(width, max(16, next_power_of_2(k)))
    scaled = block_k < k
    if not scaled:
        return 1, bk, False
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"fp8 kernels take power-of-two weight blocks of at least 16 along K, not {block_k}")
    sub = min(block_k, bk)
    return bk // sub, sub, True


def config_key(rows: int, n: int, k: int) -> str:
    """Tuning-table key: exact (N, K) and the rows rounded up to a power of two (as skinny_gemm's)."""
    return f"n{n}_k{k}_m{next_power_of_2(max(rows, 1))}"


def lookup_config(rows: int, n: int, k: int, device: torch.device | None = None) -> dict:
    return tuning.kernel_config(TUNING_PACKAGE, KERNEL, config_key(rows, n, k), DEFAULTS, device)


def decode_config(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device) -> dict:
    """Path, tiles and split-K of one decode call from the table entry: about ``target_waves`` programs per
    SM where K allows (each split keeps at least ``min_split_cols`` / ``dot_min_split_cols`` columns)."""
    cfg = lookup_config(m, n, k, device if on_gpu(device) else None)
    use_dot = m > 1
    if use_dot:
        bm = max(16, next_power_of_2(m))
        bn = cfg["DOT_BLOCK_N"] or (32 if m <= 16 else 64)
        width = cfg["DOT_BLOCK_K"]
    else:
        bm, bn, width = 1, cfg["BLOCK_N"], cfg["BLOCK_K"]
    nsub, sub_k, scaled = k_layout(k, block_k, width)
    if use_dot:  # one scale per multi-row tile
        nsub = 1
    tiles = cdiv(n, bn) * cdiv(m, bm)
    k_blocks = cdiv(k, nsub * sub_k)
    split = cfg["split_k"]
    if not split:  # 144 tiles on 132 SMs would leave a near-empty second wave: split until ~target_waves
        want, split = cfg["target_waves"] * sm_count(device), 1
        per_split = max(1, cfg["dot_min_split_cols" if use_dot else "min_split_cols"] // (nsub * sub_k))
        while tiles * split < want and split * 2 * per_split <= k_blocks:
            split *= 2
    k_tiles = cdiv(k_blocks, max(1, min(split, k_blocks)))
    split = cdiv(k_blocks, k_tiles)
    # preload (one row): a program's K tiles as one tile, loaded before the PDL wait (a power of two wide)
    preload = bool(not use_dot and cfg.get("preload", False) and (nsub * k_tiles) & (nsub * k_tiles - 1) == 0)
    if preload:
        nsub, k_tiles = nsub * k_tiles, 1
    return dict(USE_DOT=use_dot, BLOCK_M=bm, BLOCK_N=bn, NSUB=nsub, SUB_K=sub_k, K_SCALED=scaled, preload=preload,
                K_TILES=k_tiles, split_k=split, fast_bf16=cfg["fast_bf16"],
                unroll=bool(use_dot and cfg["dot_unroll"]), scale_w=bool(use_dot and cfg["dot_scale_w"]),
                num_warps=cfg["dot_num_warps"] if use_dot else cfg["num_warps"],
                num_stages=cfg["dot_num_stages"] if use_dot and on_gpu(device) else 1)


def fp8_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                    bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride), weight fp8 [N, K], scale fp32 [ceil(N / bn), ceil(K / bk)] (checked
    by the caller) -> [M, N] in x's dtype. ``config`` overrides keys of ``decode_config`` (tests, sweeps)."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = {**decode_config(m, n, k, block_n, block_k, x.device), **(config or {})}
    if cfg["USE_DOT"] != (cfg["BLOCK_M"] > 1) or (cfg["USE_DOT"] and cfg["NSUB"] != 1) or \
            (cfg.get("preload", False) and (cfg["USE_DOT"] or cfg["K_TILES"] != 1)):
        raise ValueError(f"fp8_skinny_gemm: inconsistent config {cfg}")
    width = cfg["NSUB"] * cfg["SUB_K"]
    split = cfg["split_k"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    tickets = ticket_buffer(x.device, tiles)  # untouched without a split
    part = torch.empty(split if split > 1 else 1, m, n if split > 1 else 1, dtype=torch.float32, device=x.device)
    grid = (cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    rows_share = block_n % cfg["BLOCK_N"] == 0  # one scale row for a whole tile
    _fp8_skinny_kernel[grid](
        x, weight, scale, bias if bias is not None else out, out, part, tickets,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), scale.stride(0),
        scale.stride(1) if scale.shape[1] > 1 else 0, split,
        GROUP_N=block_n, GROUP_K=block_k if cfg["K_SCALED"] else 1 << 30, K_SCALED=cfg["K_SCALED"],
        ROWS_SHARE=rows_share, HAS_BIAS=bias is not None, USE_DOT=cfg["USE_DOT"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=k % (width * cfg["K_TILES"]) == 0, K_TILES=cfg["K_TILES"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], NSUB=cfg["NSUB"], SUB_K=cfg["SUB_K"],
        FAST_BF16=cfg.get("fast_bf16", True) and x.dtype == torch.bfloat16 and on_gpu(x.device),
        UNROLL=cfg.get("unroll", False), PRELOAD=cfg.get("preload", False),
        SCALE_W=cfg.get("scale_w", False) and cfg["K_SCALED"] and rows_share,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(x.device, prefetch="weights"),
    )  # fmt: skip
    return out
