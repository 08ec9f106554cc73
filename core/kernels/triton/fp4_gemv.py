"""Skinny NVFP4 GEMM for decode (up to 64 rows): the packed e2m1 weight streamed once in 16-byte loads, unpacked in registers, fp8 group and fp32 row scales applied.

``y = x @ W.T (+ b)`` with W NVFP4 as ``armillary.kernels.fp4`` lays it out: codes uint8 [N, K / 2]
(column 2j in the low nibble), e4m3 scales [N, K / 16], fp32 row global scales [N]; x stays in
its dtype (weight-only, W4A16). A 4-bit weight streams half the bytes of FP8, so on Hopper the
cost is the unpacking, which is done with integer bit moves, never a table or a conversion:

- a code ``s m m m`` moved to bits 31 / 24..22 of an fp32 word *is* ``e2m1 · 2^-126`` (the code
  0.5 lands on the subnormal 2^-127, which fp32 keeps: no FTZ in these kernels), three integer
  ops per value (shift, arithmetic shift, mask: ``e2m1_bits``); the 2^-126 is paid back by ``FOLD`` = 2^63 on each side, so every
  product stays a normal number;
- one row (``fma``): the weight read as int32 words [BLOCK_N, BLOCK_K / 8] (8 codes each), code i
  of every word against x[8j + i], products summed per word, the word's group scale multiplied
  into that sum (once per 8 values), one cross-lane reduction at the end;
- 2-64 rows (``dot``): bytes [BLOCK_N, BLOCK_K / 2] unpacked into low / high values times their
  group scales in x's dtype, each multiplied on the tensor cores (as the A operand, from
  registers) against x's even / odd columns, loads pipelined through shared memory.

Split K (shapes with few row tiles), the deterministic last-arriver sum and PDL are skinny_gemm's
/ fp8_skinny's. ``dequantize`` unpacks a whole weight (or stack of experts) into a dtype in one
launch with the same bit moves (the prefill ``dequant`` variants of fp4_gemm / fp4_moe). Launch configs: the ``fp4_skinny`` entries of core's tuning tables (bench/fp4_skinny_sweep.py).
Reference: ``armillary.kernels.fp4.linear``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.fp8_skinny import on_gpu, pdl_options, sm_count
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import pdl_launch_dependents, pdl_wait, prefetch_rows_l2
from armillary.kernels.triton.split_k import split_k_epilogue

FP4_GROUP = 16
DECODE_MAX_ROWS = 64  # up to this many rows stream W with unquantized activations
FOLD = tl.constexpr(2.0 ** 63)  # e2m1_bits gives value · 2^-126: 2^63 into x (or the scales), 2^63 after the sum
TUNING_PACKAGE = "armillary.kernels"
KERNEL = "fp4_skinny"
# BLOCK_K in weight columns (fma: 8 per int32 word, dot: 2 per byte); split_k 0: enough for target_waves
DEFAULTS = {
    "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "DOT_BLOCK_N": 0, "DOT_BLOCK_K": 256, "dot_num_warps": 4,
    "dot_num_stages": 3, "split_k": 0, "target_waves": 2,
}  # fmt: skip


@triton.jit
def e2m1_bits(t):
    """int32 with a code's sign at bit 31 and magnitude at bits 30..28 -> fp32 ``e2m1 · 2^-126``: the arithmetic
    shift carries the sign down with the magnitude, one mask keeps bit 31 and bits 24..22 (2 ops)."""
    bits = (t >> 6) & -2118123520  # 0x81C00000 as an int32
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequant_halves(b, s, dtype: tl.constexpr):
    """Packed bytes [R, C] and each byte's group scale [R, C] -> (low, high) [R, C] ``e2m1 · scale`` in ``dtype``:
    columns 2c and 2c + 1 of the weight. The dot kernels multiply them against x's even and odd columns
    (no interleaving: Triton 3.6's dot-operand pass fails on a joined operand)."""
    bi = b.to(tl.int32)
    sf = s.to(tl.float32) * FOLD  # 2^-126 · 2^63 · 2^63: two exact steps, neither overflows
    lo = (e2m1_bits(bi << 28) * sf * FOLD).to(dtype)
    hi = (e2m1_bits(bi << 24) * sf * FOLD).to(dtype)
    return lo, hi


@triton.jit
def dequant_bytes(b, s, dtype: tl.constexpr):
    """Packed bytes [R, C] (uint8) and the group scale of each byte (float, [R, C]) -> [R, 2C] ``e2m1 · scale``
    in ``dtype`` (exact in fp32, |v| <= 2688: fits fp16), columns interleaved low / high."""
    lo, hi = dequant_halves(b, s, dtype)
    w = tl.join(lo, hi)  # [R, C, 2]: column 2c low, 2c + 1 high
    return tl.reshape(w, [lo.shape[0], 2 * lo.shape[1]])


@triton.jit
def word_products(w, x_ptr, k0, K, EVEN_K: tl.constexpr, KW: tl.constexpr):
    """Σ_i code_i(w[r, j]) · x[k0 + 8j + i] · 2^63 over a word's 8 codes: fp32 [R, KW] (still times 2^-126)."""
    cols = k0 + tl.arange(0, KW) * 8
    p = tl.zeros(w.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        if EVEN_K:
            xi = tl.load(x_ptr + cols + i)
        else:
            xi = tl.load(x_ptr + cols + i, mask=cols + i < K, other=0.0)
        p += e2m1_bits(w << (28 - 4 * i)) * (xi.to(tl.float32) * FOLD)[None, :]  # w: int32 words
    return p


@triton.jit
def _word_tile(w_ptr, s_ptr, rows, k0, K, stride_wn, stride_sn, EVEN_K: tl.constexpr, KW: tl.constexpr):
    """One row-path tile from column k0: int32 weight words [BN, KW] and each word's e4m3 group scale [BN, KW]."""
    offs_w = tl.arange(0, KW)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + (k0 // 8 + offs_w)[None, :]
    s_ptrs = s_ptr + rows[:, None].to(tl.int64) * stride_sn + (k0 // 16 + offs_w // 2)[None, :]  # two words a group
    if EVEN_K:
        return tl.load(w_ptrs, eviction_policy="evict_first"), tl.load(s_ptrs)
    w_ok = (offs_w < (K - k0) // 8)[None, :]
    return tl.load(w_ptrs, mask=w_ok, other=0, eviction_policy="evict_first"), tl.load(s_ptrs, mask=w_ok, other=0.0)


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp4_skinny_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, split_k,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """Grid (N tiles, M tiles, split_k): program (n, m, s) computes out tile (m, n) over K tiles
    [s · K_TILES, (s + 1) · K_TILES) of BLOCK_K columns. w_ptr: int32 words [N, K / 8] (fma, stride_wn in
    words) or bytes [N, K / 2] (dot, stride_wn in bytes); s_ptr e4m3 [N, K / 16]; g_ptr fp32 [N].
    part_ptr [split_k, M, N] fp32, ticket_ptr [M tiles · N tiles] int32 (zero between calls). PRELOAD (one row,
    K_TILES 1): the program's weight words and group scales are loaded before the PDL wait."""
    pdl_launch_dependents(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    rows = offs_n % N  # clamped rows keep the weight loads unmasked (wide); their sums are not stored
    k_lo = pid_k * (K_TILES * BLOCK_K)
    if PREFETCH:  # weights and their scales are not the previous kernel's: ask for them before waiting
        k_hi = tl.minimum(k_lo + K_TILES * BLOCK_K, K)
        per: tl.constexpr = 2 if USE_DOT else 8  # columns a weight element (byte / int32 word) holds
        prefetch_rows_l2(w_ptr, rows, stride_wn, k_lo // per, k_hi // per, BLOCK_K // per)
        prefetch_rows_l2(s_ptr, rows, stride_sn, k_lo // 16, k_hi // 16, BLOCK_K // 16)
    if PRELOAD:  # static weights: in registers while the previous kernel ends
        w_pre, s_pre = _word_tile(w_ptr, s_ptr, rows, k_lo, K, stride_wn, stride_sn, EVEN_K, BLOCK_K // 8)
    pdl_wait(PDL)
    if USE_DOT:
        KB: tl.constexpr = BLOCK_K // 2
        offs_b = tl.arange(0, KB)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_b[None, :]  # [BN, KB] bytes
        s_ptrs = s_ptr + rows[:, None].to(tl.int64) * stride_sn + (offs_b // 8)[None, :]  # each byte's group
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kt in range(K_TILES):
            k0 = k_lo + kt * BLOCK_K
            if EVEN_K:
                b = tl.load(w_ptrs + k0 // 2, eviction_policy="evict_first")
                s = tl.load(s_ptrs + k0 // 16)
                x = tl.load(x_ptrs + k0)
            else:
                b_ok = (offs_b < (K - k0) // 2)[None, :]
                b = tl.load(w_ptrs + k0 // 2, mask=b_ok, other=0, eviction_policy="evict_first")
                s = tl.load(s_ptrs + k0 // 16, mask=b_ok, other=0.0)
                x = tl.load(x_ptrs + k0, mask=(offs_k < K - k0)[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, KB, 2]))  # [BM, KB] each, in registers
            lo, hi = dequant_halves(b, s, x.dtype)  # [BN, KB] each: columns 2c, 2c + 1
            acc = tl.dot(lo, tl.trans(x_even), acc, input_precision=DOT_PRECISION)  # [BN, BM] fp32
            acc = tl.dot(hi, tl.trans(x_odd), acc, input_precision=DOT_PRECISION)
    else:  # one row
        KW: tl.constexpr = BLOCK_K // 8
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        wide = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
        if PRELOAD:
            wide = word_products(w_pre, x_row, k_lo, K, EVEN_K, KW) * s_pre.to(tl.float32)
        else:
            for kt in tl.static_range(K_TILES):
                k0 = k_lo + kt * BLOCK_K
                w, s = _word_tile(w_ptr, s_ptr, rows, k0, K, stride_wn, stride_sn, EVEN_K, KW)
                wide += word_products(w, x_row, k0, K, EVEN_K, KW) * s.to(tl.float32)
        acc = tl.sum(wide, axis=1)[:, None] * FOLD  # [BN, 1]: 2^63 paid back
    acc = acc * tl.load(g_ptr + rows)[:, None]  # the row's global scale

    split_k_epilogue(acc, out_ptr, bias_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok, M, N, stride_om,
                     pid_n, pid_m, pid_k, split_k, HAS_BIAS, BLOCK_N, BLOCK_M)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, ROWS, K, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (cdiv(ROWS, BR), cdiv(K / 2, BC)): out[r, :] = e2m1 · scale · global[r] in out's dtype; every
    operand contiguous ([ROWS, K / 2] bytes, [ROWS, K / 16] scales, [ROWS] globals, [ROWS, K] out)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < ROWS)[:, None] & (c < K // 2)[None, :]
    r64 = r.to(tl.int64)[:, None]
    b = tl.load(w_ptr + r64 * (K // 2) + c[None, :], mask=ok, other=0)
    s = tl.load(s_ptr + r64 * (K // 16) + (c // 8)[None, :], mask=ok, other=0.0)
    g = tl.load(g_ptr + r, mask=r < ROWS, other=0.0)
    lo, hi = dequant_halves(b, s, tl.float32)
    w = tl.reshape(tl.join(lo * g[:, None], hi * g[:, None]), [BLOCK_R, 2 * BLOCK_C])
    cols = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    tl.store(out_ptr + r64 * K + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(r < ROWS)[:, None] & (cols < K)[None, :])


def dequantize(w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 [..., N, K / 2] (scales [..., N, K / 16], row globals [..., N]) -> [..., N, K] in ``dtype``, one
    launch: ``armillary.kernels.fp4.dequantize`` (the product in fp32, rounded once)."""
    *lead, n, half = w_packed.shape
    rows, k = w_packed.numel() // half, 2 * half
    out = torch.empty(*lead, n, k, dtype=dtype, device=w_packed.device)
    if rows:
        br, bc = (16, 256) if on_gpu(w_packed.device) else (8, 32)
        _dequant_kernel[(cdiv(rows, br), cdiv(half, bc))](
            w_packed.contiguous(), w_scale.contiguous(), global_scale.float().contiguous(), out, rows, k,
            BLOCK_R=br, BLOCK_C=bc, num_warps=4)
    return out


def config_key(rows: int, n: int, k: int) -> str:
    """Tuning-table key: exact (N, K) and the rows rounded up to a power of two."""
    return f"n{n}_k{k}_m{next_power_of_2(max(rows, 1))}"


def lookup_config(rows: int, n: int, k: int, device: torch.device | None = None) -> dict:
    return tuning.kernel_config(TUNING_PACKAGE, KERNEL, config_key(rows, n, k), DEFAULTS, device)


def decode_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Path, tiles and split-K of one decode call from the table entry: about ``target_waves`` programs per SM
    where K allows (each split keeps at least 4 fma or 8 dot K tiles)."""
    cfg = lookup_config(m, n, k, device if on_gpu(device) else None)
    use_dot = m > 1
    if use_dot:
        bm = max(16, next_power_of_2(m))
        bn = cfg["DOT_BLOCK_N"] or (32 if m <= 16 else 64)
        bk = max(32, min(cfg["DOT_BLOCK_K"], next_power_of_2(k)))
    else:
        bm, bn = 1, cfg["BLOCK_N"]
        bk = max(16, min(cfg["BLOCK_K"], next_power_of_2(k)))
    tiles = cdiv(n, bn) * cdiv(m, bm)
    k_blocks = cdiv(k, bk)
    split = cfg["split_k"]
    if not split:
        want, split = cfg["target_waves"] * sm_count(device), 1
        per_split = 8 if use_dot else 4
        while tiles * split < want and split * 2 * per_split <= k_blocks:
            split *= 2
    k_tiles = cdiv(k_blocks, max(1, min(split, k_blocks)))
    split = cdiv(k_blocks, k_tiles)
    # preload (one row): a program's K tiles as one tile, loaded before the PDL wait (a power of two wide)
    preload = bool(not use_dot and cfg.get("preload", False) and k_tiles & (k_tiles - 1) == 0)
    if preload:
        bk, k_tiles = bk * k_tiles, 1
    return dict(USE_DOT=use_dot, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k_tiles, preload=preload,
                split_k=split, num_warps=cfg["dot_num_warps"] if use_dot else cfg["num_warps"],
                num_stages=cfg["dot_num_stages"] if use_dot and on_gpu(device) else 1)


def as_words(w_packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K / 2] -> int32 [..., N, K / 8], the same bytes (little-endian: code 8j + i in bits 4i..4i+3)."""
    if w_packed.stride(-1) != 1 or w_packed.stride(-2) % 4 or w_packed.storage_offset() % 4:
        w_packed = w_packed.contiguous()
    return w_packed.view(torch.int32)


def fp4_skinny_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride, M <= 64), w_packed uint8 [N, K / 2], w_scale e4m3 [N, K / 16] and
    global_scale fp32 [N] (checked by the caller) -> [M, N] in x's dtype. ``config`` overrides keys of
    ``decode_config`` (tests, sweeps)."""
    m, k = x.shape
    n = w_packed.shape[0]
    cfg = {**decode_config(m, n, k, x.device), **(config or {})}
    if cfg["USE_DOT"] != (cfg["BLOCK_M"] > 1) or \
            (cfg.get("preload", False) and (cfg["USE_DOT"] or cfg["K_TILES"] != 1)):
        raise ValueError(f"fp4_skinny_gemm: inconsistent config {cfg}")
    if w_scale.stride(-1) != 1:
        w_scale = w_scale.contiguous()
    w = w_packed if cfg["USE_DOT"] else as_words(w_packed)
    if w.stride(-1) != 1:
        w = w.contiguous()
    split = cfg["split_k"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    tickets = ticket_buffer(x.device, tiles)  # untouched without a split
    part = torch.empty(split if split > 1 else 1, m, n if split > 1 else 1, dtype=torch.float32, device=x.device)
    grid = (cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    _fp4_skinny_kernel[grid](
        x, w, w_scale, global_scale, bias if bias is not None else out, out, part, tickets,
        m, n, k, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), split,
        HAS_BIAS=bias is not None, USE_DOT=cfg["USE_DOT"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=k % (cfg["BLOCK_K"] * cfg["K_TILES"]) == 0, K_TILES=cfg["K_TILES"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PRELOAD=cfg.get("preload", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(x.device, prefetch="weights"),
    )  # fmt: skip
    return out
