"""NVFP4 GEMM for prefill on Hopper's tensor cores, three variants (bf16 dequantized tile, FP8 re-rounded tile, unpack then cuBLAS), and ``fp4_linear``, which picks one or the skinny decode GEMM.

W NVFP4 [N, K] as in ``armillary.kernels.fp4`` (codes uint8 [N, K / 2], e4m3 group scales
[N, K / 16], fp32 row global scales [N]). Hopper has no FP4 tensor cores, so each K step unpacks
a [BLOCK_N, BLOCK_K] weight tile in registers (``fp4_gemv.dequant_bytes``: integer bit moves)
and multiplies it on the tensor cores in one of two ways, chosen per shape by the ``fp4_gemm``
tuning entry's ``variant`` (the GPU bench measures them all):

- ``bf16`` (default): the tile's low / high halves times their group scales in x's dtype, each
  the MMA's A operand from registers against x's even / odd columns (weight-only: what the
  reference computes, up to bf16 rounding);
- ``fp8``: x quantized per row and 128 columns to e4m3 once (``fp8_gemm.quantize_act``), the
  weight tile re-rounded to e4m3 as ``e2m1 · scale / r · 64`` with r the row's largest group scale
  in the tile (the e2m1 grid is exact in e4m3, the group-scale product loses at most 2 bits), the
  FP8 tensor cores at twice the bf16 rate, ``acc += dot · a_scale[m] · r[n] / 64``;
- ``dequant``: the whole weight unpacked once into x's dtype (``fp4_gemv.dequantize``, one launch,
  N · K values) and cuBLAS: the unpacking is paid once per call instead of once per row tile, at the
  cost of a transient [N, K] buffer.

Program ids are grouped along M so a weight column tile is reused from L2; fp32 accumulation,
the row global scale and the bias in the epilogue. Up to ``fp4_gemv.DECODE_MAX_ROWS`` rows take
the skinny GEMM instead. Reference: ``armillary.kernels.fp4.linear``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.fp4_gemv import (DECODE_MAX_ROWS, FOLD, dequant_halves, dequantize, e2m1_bits,
                                               fp4_skinny_gemm)
from armillary.kernels.triton.fp8_cast import to_e4m3
from armillary.kernels.triton.fp8_gemm import quantize_act
from armillary.kernels.triton.fp8_skinny import on_gpu
from armillary.kernels.triton.host import cdiv

__all__ = ["DECODE_MAX_ROWS", "check_weight", "fp4_linear", "fp4_prefill_gemm", "prefill_config"]
TUNING_PACKAGE = "armillary.kernels"
KERNEL = "fp4_gemm"
FP8_ACT_GROUP = 128  # the fp8 variant's activation group and K step
DEFAULTS = {"variant": "bf16", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
            "num_stages": 3}
_CPU = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) with GROUP_M row tiles walking the column tiles together (L2 reuse of W)."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _epilogue(acc, g_ptr, b_ptr, out_ptr, offs_m, offs_n, rows_w, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = acc[m, n] · global[n] (+ bias[n]) in out's dtype."""
    acc = acc * tl.load(g_ptr + rows_w)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _epilogue_t(acc, g_ptr, b_ptr, out_ptr, offs_m, offs_n, rows_w, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = acc[n, m] · global[n] (+ bias[n]): the transposed accumulator of W-as-A tiles."""
    acc = acc * tl.load(g_ptr + rows_w)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w).to(tl.float32)[:, None]
    dst = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


@triton.jit
def _fp4_bf16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BM) · cdiv(N, BN),): out = x @ (e2m1 · scale).T · global, the tile dequantized to x's dtype
    and multiplied as the MMA's A operand straight from registers (acc is out's tile transposed)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x, rows_w = offs_m % M, offs_n % N  # clamped: unmasked tile loads; the stores are masked
    KB: tl.constexpr = BLOCK_K // 2
    offs_b = tl.arange(0, KB)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_x[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]: wide async copies
    w_ptrs = w_ptr + rows_w[:, None].to(tl.int64) * stride_wn + offs_b[None, :]  # [BN, KB] bytes
    s_ptrs = s_ptr + rows_w[:, None].to(tl.int64) * stride_sn + (offs_b // 8)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
        else:
            b_ok = (offs_b < (K - k0) // 2)[None, :]
            x = tl.load(x_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=b_ok, other=0)
            s = tl.load(s_ptrs, mask=b_ok, other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, KB, 2]))  # [BM, KB] each, in registers
        lo, hi = dequant_halves(b, s, x.dtype)  # [BN, KB]: weight columns 2c, 2c + 1
        acc = tl.dot(lo, tl.trans(x_even), acc, input_precision=DOT_PRECISION)  # [BN, BM]
        acc = tl.dot(hi, tl.trans(x_odd), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += KB
        s_ptrs += BLOCK_K // 16
    _epilogue_t(acc, g_ptr, b_ptr, out_ptr, offs_m, offs_n, rows_w, M, N, stride_om, HAS_BIAS)


@triton.jit
def _fp4_fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Grid as the bf16 kernel: a e4m3 [M, K] with scales as [cdiv(K, BK), M]; the weight tile re-rounded to e4m3."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a, rows_w = offs_m % M, offs_n % N
    KB: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    offs_b = tl.arange(0, KB)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, G)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rows_w[:, None].to(tl.int64) * stride_wn + offs_b[None, :]  # [BN, KB]
    s_row = s_ptr + rows_w[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
            s = tl.load(s_row + k0 // 16 + (offs_b // 8)[None, :]).to(tl.float32)  # [BN, KB]
            sg = tl.load(s_row + k0 // 16 + offs_g[None, :]).to(tl.float32)  # [BN, G]
        else:
            b_ok = offs_b < (K - k0) // 2
            a = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=b_ok[None, :], other=0)
            s = tl.load(s_row + k0 // 16 + (offs_b // 8)[None, :], mask=b_ok[None, :], other=0.0).to(tl.float32)
            sg = tl.load(s_row + k0 // 16 + offs_g[None, :], mask=(offs_g < (K - k0) // 16)[None, :],
                         other=0.0).to(tl.float32)
        r = tl.maximum(tl.max(sg, axis=1), 1e-30)  # [BN]: the row's largest group scale in this tile
        f = s * ((64.0 * FOLD) / r[:, None])  # e2m1_bits · f · 2^63 = e2m1 · (s / r) · 64, within ±384
        bi = b.to(tl.int32)
        lo = to_e4m3(e2m1_bits(bi << 28) * f * FOLD)
        hi = to_e4m3(e2m1_bits(bi << 24) * f * FOLD)
        w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # [BN, BK] e4m3
        a_s = tl.load(as_ptr + kt * M + rows_a)  # [BM]
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * (r * (1.0 / 64.0))[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += KB
    _epilogue(acc, g_ptr, b_ptr, out_ptr, offs_m, offs_n, rows_w, M, N, stride_om, HAS_BIAS)


def prefill_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The ``fp4_gemm`` entry for (N, K) (small tiles under the interpreter)."""
    key = f"n{n}_k{k}"
    if not on_gpu(device):
        return {**tuning.kernel_config(TUNING_PACKAGE, KERNEL, key, DEFAULTS, None), **_CPU}
    cfg = tuning.kernel_config(TUNING_PACKAGE, KERNEL, key, DEFAULTS, device)
    if m < 128:
        cfg = {**cfg, "BLOCK_M": 64, "num_warps": 4}
    return cfg


def fp4_prefill_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride) -> [M, N] in x's dtype through the tensor-core tile kernel of
    ``config["variant"]`` ("bf16" | "fp8" | "dequant"; default the tuning table's)."""
    m, k = x.shape
    n = w_packed.shape[0]
    cfg = {**prefill_config(m, n, k, x.device), **(config or {})}
    out = x.new_empty(m, n)
    if m == 0:
        return out
    w_packed = w_packed if w_packed.stride(-1) == 1 else w_packed.contiguous()
    w_scale = w_scale if w_scale.stride(-1) == 1 else w_scale.contiguous()
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    bias_arg = bias if bias is not None else out
    if cfg["variant"] == "dequant":  # unpacked once, then cuBLAS (a transient [N, K] in x's dtype)
        return torch.nn.functional.linear(x, dequantize(w_packed, w_scale, global_scale, x.dtype), bias)
    if cfg["variant"] == "fp8":
        xq, xs = quantize_act(x, FP8_ACT_GROUP)  # [M, K] e4m3, [K / 128, M]
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
        _fp4_fp8_gemm_kernel[grid](
            xq, xs, w_packed, w_scale, global_scale, bias_arg, out, m, n, k, xq.stride(0), w_packed.stride(0),
            w_scale.stride(0), out.stride(0), EVEN_K=k % FP8_ACT_GROUP == 0, BLOCK_K=FP8_ACT_GROUP, **common)
        return out
    if cfg["variant"] != "bf16":
        raise ValueError(f"fp4_prefill_gemm: variant must be 'bf16', 'fp8' or 'dequant', not {cfg['variant']!r}")
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _fp4_bf16_gemm_kernel[grid](
        x, w_packed, w_scale, global_scale, bias_arg, out, m, n, k, x.stride(0), w_packed.stride(0),
        w_scale.stride(0), out.stride(0), EVEN_K=k % cfg["BLOCK_K"] == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_K=cfg["BLOCK_K"], **common)
    return out


def check_weight(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    """A ``ValueError`` saying which tensor of an NVFP4 linear does not fit x [M, K]."""
    m, k = x.shape
    n = w_packed.shape[0]
    if w_packed.dtype != torch.uint8 or w_packed.shape != (n, k // 2) or k % 16:
        raise ValueError(f"fp4_linear: packed weight {w_packed.dtype} {tuple(w_packed.shape)} does not fit x "
                         f"{tuple(x.shape)} (uint8 [N, K / 2], K a multiple of 16)")
    if w_scale.dtype != torch.float8_e4m3fn or w_scale.shape != (n, k // 16):
        raise ValueError(f"fp4_linear: group scales {w_scale.dtype} {tuple(w_scale.shape)}, want float8_e4m3fn "
                         f"[{n}, {k // 16}]")
    if global_scale.dtype != torch.float32 or global_scale.shape != (n,) or global_scale.stride(0) != 1:
        raise ValueError(f"fp4_linear: global scale {global_scale.dtype} {tuple(global_scale.shape)}, want "
                         f"contiguous fp32 [{n}]")
    if x.stride(1) != 1:
        raise ValueError("fp4_linear: x needs a unit last stride")


def fp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``interfaces.Fp4Linear`` on Hopper (and any GPU): skinny GEMM up to 64 rows, else the prefill tile
    kernel. ``config`` overrides the chosen path's keys (``prefill: True`` forces the tile kernel)."""
    check_weight(x, w_packed, w_scale, global_scale)
    if x.shape[0] == 0:
        return x.new_empty(0, w_packed.shape[0])
    cfg = dict(config or {})
    if x.shape[0] <= DECODE_MAX_ROWS and not cfg.pop("prefill", False):
        return fp4_skinny_gemm(x, w_packed, w_scale, global_scale, bias, cfg)
    cfg.pop("prefill", None)
    return fp4_prefill_gemm(x, w_packed, w_scale, global_scale, bias, cfg)
