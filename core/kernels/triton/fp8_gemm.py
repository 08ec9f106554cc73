"""Block-scaled FP8 GEMM for prefill on the fp8 tensor cores, its activation quantization pass, a one-launch block dequantization, and ``fp8_linear`` (which picks it or the skinny decode GEMM).

``y = x @ (W · S).T``: W float8_e4m3fn [N, K], S fp32 [ceil(N / bn), ceil(K / bk)] (per-channel:
bn 1, bk >= K). Up to ``fp8_skinny.DECODE_MAX_ROWS`` rows stream W with x unquantized
(fp8_skinny.py); more rows take two launches:

- ``quantize_act``: x per row and group of G = min(bk, 128) columns to e4m3 (amax / 448, exact
  IEEE divisions: bit-equal to ``armillary.kernels.fp8.quantize_act_groups``), scales stored
  group-major [K / G, M] so a GEMM tile reads its BLOCK_M row scales contiguously;
- the GEMM: [BLOCK_M, G] x [G, BLOCK_N] fp8 tiles (both K-major, as the fp8 wgmma wants) through a
  num_stages-deep shared-memory pipeline, ``acc += dot · a_scale[m] · w_scale`` per K step (one
  weight scale per step when BLOCK_N rows share a scale row), fp32 accumulation, bf16 out; program
  ids grouped along M so a W column tile is reused from L2;
- or, for 128 x 128 blocks past ``fp8_scaled_mm.MIN_ROWS`` rows on a GPU whose one-time probe passed,
  the same quantization (rows padded) into cuBLASLt's block-scaled ``torch._scaled_mm``
  (fp8_scaled_mm.py), about twice the Triton GEMM's rate on an H200.

``dequantize_blocks`` unpacks a block-scaled weight (or a stack of experts) into x's dtype in one launch,
for paths that trade a transient copy for bf16 GEMMs (fp8_moe's dequant variant).

Reference: ``armillary.kernels.fp8.linear_w8a8`` (prefill) / ``linear`` (decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.fp8 import FP8_MAX
from armillary.kernels.triton import fp8_scaled_mm
from armillary.kernels.triton.fp8_cast import exact_div, to_e4m3
from armillary.kernels.triton.fp8_skinny import DECODE_MAX_ROWS, fp8_skinny_gemm, on_gpu
from armillary.kernels.triton.host import cdiv, next_power_of_2

__all__ = ["DECODE_MAX_ROWS", "act_group", "dequantize_blocks", "fp8_linear", "prefill_config", "quantize_act", "use_scaled_mm"]
_QUANT_ELEMS = 2048  # elements of x per quantization program


@triton.jit
def _exact_activation(x, ACTIVATION: tl.constexpr):
    """moe_decode's activation codes (0 silu, 1 relu², 2 gelu-tanh) in fp32 with IEEE divisions, as torch
    divides: this pass is checked free of approximate divisions."""
    if ACTIVATION == 0:
        return exact_div(x, 1.0 + tl.exp(-x))
    elif ACTIVATION == 1:
        r = tl.maximum(x, 0.0)
        return r * r
    else:  # gelu_tanh(x) = x · sigmoid(2·sqrt(2/pi)·(x + 0.044715·x³))
        return exact_div(x, 1.0 + tl.exp(-1.5957691216057308 * (x + 0.044715 * x * x * x)))


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, ROWS, stride_xm, stride_qm, up_offset, GROUPS_PER_PROG: tl.constexpr,
                      GROUP: tl.constexpr, FP8_LIMIT: tl.constexpr, APPLY_ACT: tl.constexpr, ACTIVATION: tl.constexpr,
                      GATED: tl.constexpr):
    """Grid (ROWS, cdiv(K / GROUP, GROUPS_PER_PROG)): q [ROWS, K] e4m3, s [cdiv(K, GROUP), ROWS] fp32
    (group-major); rows M..ROWS-1 (padding) quantize zeros. APPLY_ACT: the values quantized are act(x[:, :K])
    (times x[:, up_offset:][:, :K] when GATED), each product rounded to x's dtype as torch's act_and_mul does."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GPP, GROUP]
    ok = cols < K
    real = (cols * 0 + row) < M  # [GPP, GROUP]: a padding row loads nothing
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok & real, other=0.0)
    if APPLY_ACT:
        x = _exact_activation(x.to(tl.float32), ACTIVATION).to(x_ptr.dtype.element_ty)
        if GATED:
            up = tl.load(x_ptr + row * stride_xm + up_offset + cols, mask=ok & real, other=0.0)
            x = (x.to(tl.float32) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GPP]
    scale = tl.maximum(exact_div(amax, tl.full(amax.shape, FP8_LIMIT, tl.float32)), 1e-12)
    q = to_e4m3(exact_div(x, tl.broadcast_to(scale[:, None], x.shape)))
    tl.store(q_ptr + row * stride_qm + cols, q, mask=ok)
    tl.store(s_ptr + g.to(tl.int64) * ROWS + row, scale, mask=g * GROUP < K)


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
    stride_am, stride_wn, stride_om, stride_sn, stride_sk,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS_SHARE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BM) · cdiv(N, BN),): out [M, N] = Σ_k dot(a, w) · as[k, m] · s[n / bn, k / bk].

    a: [M, K] e4m3, as: [cdiv(K, BLOCK_K), M] fp32 (one per BLOCK_K group), w: [N, K] e4m3."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # GROUP_M row tiles walk the column tiles together (L2 reuse of W)
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a, rows_w = offs_m % M, offs_n % N  # clamped: unmasked tile loads; the stores are masked
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rows_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN], K-major
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + kt * M + rows_a)  # [BM]
        if ROWS_SHARE:
            w_s = tl.load(s_ptr + row_blk * stride_sn + (k0 // GROUP_K) * stride_sk)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s)  # fp8 x fp8 -> fp32 on the tensor cores
        else:
            w_s = tl.load(s_ptr + (rows_w // GROUP_N) * stride_sn + (k0 // GROUP_K) * stride_sk)  # [BN]
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _dequant_blocks_kernel(w_ptr, s_ptr, out_ptr, N, K, SCALE_ROWS, SCALE_COLS, GROUP_N: tl.constexpr,
                           GROUP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (lead * cdiv(N, BR), cdiv(K, BC)): out[e, n, k] = w[e, n, k] · s[e, n / GROUP_N, k / GROUP_K] in
    out's dtype (fp32 product, rounded once); w [lead, N, K], s [lead, SCALE_ROWS, SCALE_COLS], out like w,
    all contiguous."""
    tiles_n = tl.cdiv(N, BLOCK_R)
    lead = (tl.program_id(0) // tiles_n).to(tl.int64)
    r = (tl.program_id(0) % tiles_n) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < N)[:, None] & (c < K)[None, :]
    at = lead * N * K + r.to(tl.int64)[:, None] * K + c[None, :]
    w = tl.load(w_ptr + at, mask=ok, other=0.0).to(tl.float32)
    sc = tl.load(s_ptr + lead * SCALE_ROWS * SCALE_COLS + (r // GROUP_N)[:, None] * SCALE_COLS + (c // GROUP_K)[None, :],
                 mask=ok, other=0.0)
    tl.store(out_ptr + at, (w * sc).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """fp8 [..., N, K] with block scales [..., ceil(N / bn), ceil(K / bk)] -> [..., N, K] in ``dtype``, one
    launch: ``armillary.kernels.fp8.dequantize`` (the product in fp32, rounded once)."""
    *lead, n, k = weight.shape
    out = torch.empty(*lead, n, k, dtype=dtype, device=weight.device)
    count = weight.numel() // max(n * k, 1)
    if out.numel():
        br, bc = (32, 256) if on_gpu(weight.device) else (8, 32)
        _dequant_blocks_kernel[(count * cdiv(n, br), cdiv(k, bc))](
            weight.contiguous(), scale.float().contiguous(), out, n, k, scale.shape[-2], scale.shape[-1],
            GROUP_N=block_n, GROUP_K=block_k, BLOCK_R=br, BLOCK_C=bc, num_warps=4)
    return out


def act_group(k: int, block_k: int) -> int:
    """The activation quantization group, which is the prefill BLOCK_K: min(bk, 128) as the reference
    groups (a power of two >= 16), or one power-of-two tile over the whole row when that covers K."""
    g = min(block_k, 128)
    if g >= k:
        return max(16, next_power_of_2(k))
    if g & (g - 1) or g < 16:
        raise ValueError(f"fp8 prefill GEMM takes power-of-two weight blocks of at least 16 along K, not {block_k}")
    return g


def quantize_act(x: torch.Tensor, group: int, rows: int | None = None, activation: int | None = None,
                 gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [R, K], fp32 scales [cdiv(K, group), R]) with R = ``rows`` (>= M, default M;
    rows past M are zeros with scale 1e-12): one launch, bit-equal to the reference on the first M rows.
    ``activation`` (a moe_decode ACT_* code): quantize act(x) instead, or with ``gated`` x [M, 2K] = [gate | up]
    and act(gate) · up (act_and_mul in the same launch)."""
    m, k = x.shape
    if gated:
        if activation is None or k % 2:
            raise ValueError(f"quantize_act: gated input takes an activation and an even width, not {activation}, {k}")
        k //= 2
    r = m if rows is None else rows
    if r < m:
        raise ValueError(f"quantize_act: {r} output rows cannot hold {m}")
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    groups = cdiv(k, group)
    s = torch.empty(groups, r, dtype=torch.float32, device=x.device)
    if r == 0:
        return q, s
    gpp = min(next_power_of_2(groups), max(1, _QUANT_ELEMS // group))
    _quant_act_kernel[(r, cdiv(groups, gpp))](x, q, s, m, k, r, x.stride(0), q.stride(0), k,
                                                     GROUPS_PER_PROG=gpp, GROUP=group, FP8_LIMIT=FP8_MAX,
                                                     APPLY_ACT=activation is not None, ACTIVATION=activation or 0,
                                                     GATED=gated, num_warps=4)
    return q, s


def prefill_config(m: int, on_gpu: bool) -> dict:
    """Tiles of the fp8 tensor-core GEMM: 128 x 128 (8 warps, 4 stages) for big M, 64 rows below 128."""
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=4, num_warps=4, num_stages=1)
    if m >= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)


def use_scaled_mm(m: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                  choice: bool | None = None) -> bool:
    """Whether a prefill call of ``m`` rows takes cuBLAS's block-scaled GEMM (fp8_scaled_mm): ``choice``
    None decides by its shape rules (more than MIN_ROWS rows) and the device's one-time probe, False
    never, True whenever the shape fits (a ValueError where it does not or the device lacks it)."""
    if choice is False:
        return False
    fits = fp8_scaled_mm.fits(m, x, weight, scale, block_n, block_k, min_rows=0 if choice else fp8_scaled_mm.MIN_ROWS)
    if choice and not (fits and fp8_scaled_mm.ready(x.device, quantize_act)):
        raise ValueError(f"fp8_linear: torch._scaled_mm block scaling does not take weight {tuple(weight.shape)} in "
                         f"blocks of ({block_n}, {block_k}) with {x.dtype} rows on {x.device}")
    return fits and fp8_scaled_mm.ready(x.device, quantize_act)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               bias: torch.Tensor | None = None, config: dict | None = None,
               tail: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, unit last stride), weight fp8 [N, K] contiguous rows, scale fp32
    [ceil(N / bn), ceil(K / bk)] -> [M, N] in x's dtype; ``tail`` [N_t, K] in x's dtype: unquantized rows
    after the fp8 ones, written into the same output ([M, N + N_t]; ``bias`` then covers all of them).
    ``config`` overrides the chosen path's keys (``prefill: True`` forces a prefill path; ``scaled_mm``:
    True / False forces cuBLAS / Triton for it). On cuBLAS a weight whose N is not whole 128-row blocks
    runs its whole blocks there and the last rows on the Triton GEMM, into one output."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} / weight {tuple(weight.shape)} need matching K with unit stride")
    if scale.shape != (cdiv(n, block_n), cdiv(k, block_k)) and not (block_k >= k and scale.shape == (cdiv(n, block_n), 1)):
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         f"in blocks of ({block_n}, {block_k})")
    if tail is not None and (tail.shape[1] != k or tail.dtype != x.dtype):
        raise ValueError(f"fp8_linear: tail {tuple(tail.shape)} {tail.dtype} must be [N_t, {k}] in {x.dtype}")
    width = n + (tail.shape[0] if tail is not None else 0)
    if m == 0:
        return x.new_empty(0, width)
    fp8_bias, tail_bias = (bias[:n], bias[n:]) if bias is not None and tail is not None else (bias, None)
    cfg = dict(config or {})
    if m <= DECODE_MAX_ROWS and not cfg.pop("prefill", False):
        out = fp8_skinny_gemm(x, weight, scale, block_n, block_k, fp8_bias, cfg)
        return out if tail is None else torch.cat([out, torch.nn.functional.linear(x, tail, tail_bias)], dim=-1)
    cfg.pop("prefill", None)
    if use_scaled_mm(m, x, weight, scale, block_n, block_k, cfg.pop("scaled_mm", None)):
        rows = fp8_scaled_mm.padded_rows(m)
        xq, xs = quantize_act(x, fp8_scaled_mm.BLOCK, rows)  # [Mp, K], [K / 128, Mp]
        out = x.new_empty(rows, width)
        whole = n - n % fp8_scaled_mm.BLOCK  # cuBLAS takes whole 128-row blocks; the rest the Triton GEMM
        fp8_scaled_mm.matmul(xq, xs, weight[:whole], scale[: whole // fp8_scaled_mm.BLOCK],
                             fp8_bias[:whole] if fp8_bias is not None else None, x.dtype, rows, out=out[:, :whole])
        if whole < n:
            _block_gemm(xq, xs, weight[whole:], scale[whole // block_n:], block_n, block_k,
                        fp8_bias[whole:] if fp8_bias is not None else None, out[:, whole:n], cfg)
    else:
        xq, xs = quantize_act(x, act_group(k, block_k))
        out = x.new_empty(m, width)
        _block_gemm(xq, xs, weight, scale, block_n, block_k, fp8_bias, out[:, :n], cfg)
    if tail is not None:  # written in place: a concatenation would copy the whole output again
        torch.mm(x, tail.t(), out=out[:m, n:])
        if tail_bias is not None:
            out[:m, n:] += tail_bias
    return out[:m]


def _block_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int, bias: torch.Tensor | None, out: torch.Tensor, config: dict) -> None:
    """The Triton block GEMM of quantized rows ``xq`` [R, K] (scales ``xs`` [K / G, R]) into ``out`` [R, N]
    (unit last stride, any row stride)."""
    rows, k = xq.shape
    n = weight.shape[0]
    cfg = {**prefill_config(rows, on_gpu(xq.device)), **config}
    group = act_group(k, block_k)
    grid = (cdiv(rows, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _fp8_block_gemm_kernel[grid](
        xq, xs, weight, scale, bias if bias is not None else out, out, rows, n, k,
        xq.stride(0), weight.stride(0), out.stride(0), scale.stride(0), scale.stride(1) if scale.shape[1] > 1 else 0,
        GROUP_N=block_n, GROUP_K=block_k if block_k < k else 1 << 30,
        ROWS_SHARE=block_n % cfg["BLOCK_N"] == 0, HAS_BIAS=bias is not None, EVEN_K=k % group == 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=group, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
