"""NVFP4 on Blackwell (sm_100 / sm_120 / sm_121): activations quantized to NVFP4 per call, then the native FP4 tensor-core GEMM through ``tl.dot_scaled``.

Blackwell multiplies e2m1 operands with e4m3 scales per 16 columns in hardware (``tcgen05.mma``
on sm_100, ``mma ... block_scale`` on sm_12x), so prefill runs W4A4:

- ``quantize_act_nvfp4``: a program per row of x: global scale amax / (6 · 448) per row, each 16
  columns' scale amax / 6 / global rounded to e4m3, each value divided by scale · global (IEEE
  divisions) and rounded to the nearest e2m1 (ties to even), packed two a byte low nibble first:
  exactly ``armillary.kernels.fp4.quantize_nvfp4`` applied to each row as its own matrix;
- the GEMM: [BLOCK_M, BLOCK_K / 2] x [BLOCK_N, BLOCK_K / 2] packed tiles and their [., BLOCK_K / 16]
  scales into ``tl.dot_scaled(a, a_scale, "e2m1", w.T, w_scale, "e2m1")``, fp32 accumulation, the
  two global scales (row of x, row of W) and the bias in the epilogue. ``NATIVE=False`` is the same
  kernel with the operands dequantized for ``tl.dot`` (the interpreter, whose ``dot_scaled`` reads
  e8m0 scales only, tests every load, mask and epilogue with it).

Decode (up to 64 rows) stays weight-only on ``fp4_gemv`` (memory-bound: 4-bit weights either way);
``"w4a4": false`` in the table keeps prefill weight-only too (fp4_gemm's tiles, numerically the reference's).
``fp4_linear`` here is the dispatch's choice on capability 10+ (``supports``). Launch configs:
``fp4_blackwell`` in core's sm_100 / sm_120 / sm_121 tables.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.fp4_gemm import check_weight, fp4_prefill_gemm
from armillary.kernels.triton.fp4_gemv import DECODE_MAX_ROWS, dequant_bytes, fp4_skinny_gemm
from armillary.kernels.triton.fp8_cast import exact_div, to_e4m3
from armillary.kernels.triton.fp8_skinny import on_gpu
from armillary.kernels.triton.host import cdiv, next_power_of_2

TUNING_PACKAGE = "armillary.kernels"
KERNEL = "fp4_blackwell"
# "w4a4": prefill on the FP4 MMA with NVFP4 activations (as vLLM's Blackwell path); False keeps it weight-only
DEFAULTS = {"w4a4": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
            "num_stages": 3}
_CPU = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}
OFFLINE_NATIVE = False  # set by bench/nvfp4_compile_check.py: configure the native path with no GPU


_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])


@lru_cache(maxsize=None)
def capability(index: int | None) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``; (0, 0) without CUDA."""
    return tuple(torch.cuda.get_device_capability(index)) if torch.cuda.is_available() else (0, 0)


def native_fp4(cap: tuple[int, int], triton_version: tuple[int, int] = _TRITON) -> bool:
    """Whether this Triton lowers the NVFP4 scaled dot natively for ``cap``: sm_100 / sm_120 on 3.6 (checked
    offline), sm_121 only from 3.9 (3.6's matmul pass rejects it; 3.9 emits the block-scaled mma.sync)."""
    if not hasattr(tl, "dot_scaled") or cap[0] < 10:
        return False
    return cap != (12, 1) or triton_version >= (3, 9)


def supports(device: torch.device, dtype: torch.dtype | None, *, tuned_only: bool = True, **_: object) -> bool:
    """CUDA devices whose FP4 MMA this Triton drives (``native_fp4``); others take the Hopper kernels."""
    return device.type == "cuda" and native_fp4(capability(device.index))


@triton.jit
def _e2m1_code(a):
    """|v| (fp32, divided by its scale, <= 6) -> magnitude code 0..7: round to nearest, ties to the even code."""
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    return c + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)


@triton.jit
def _quant_nvfp4_kernel(x_ptr, q_ptr, s_ptr, g_ptr, K, stride_xm, stride_qm, stride_sm, GROUPS: tl.constexpr):
    """Grid (M,): row m of x [M, K] -> q uint8 [M, K / 2], s e4m3 [M, K / 16], g fp32 [M] (GROUPS >= K / 16)."""
    row = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, GROUPS)
    cols = gi[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    g = tl.where(amax > 0, exact_div(amax, 2688.0), 1.0)  # 6 · 448
    gmax = tl.max(tl.abs(x), axis=1)  # [G]
    six = tl.full(gmax.shape, 6.0, tl.float32)
    s8 = to_e4m3(exact_div(exact_div(gmax, six), g + tl.zeros_like(gmax)))  # [G] e4m3, saturated at 448
    denom = s8.to(tl.float32) * g  # [G]
    safe = tl.where(denom > 0, denom, 1.0)
    v = exact_div(x, tl.broadcast_to(safe[:, None], x.shape))
    v = tl.where(denom[:, None] > 0, v, 0.0)
    mag = _e2m1_code(tl.minimum(tl.abs(v), 6.0))
    code = mag | tl.where((v < 0) & (mag > 0), 8, 0)  # no -0 codes, as the reference
    pairs = tl.reshape(code, [GROUPS * 8, 2])
    lo, hi = tl.split(pairs)
    byte = (lo | (hi << 4)).to(tl.uint8)
    offs_b = tl.arange(0, GROUPS * 8)
    tl.store(q_ptr + row * stride_qm + offs_b, byte, mask=offs_b * 2 < K)
    tl.store(s_ptr + row * stride_sm + gi, s8, mask=gi * 16 < K)
    tl.store(g_ptr + row, g)


def quantize_act_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 16) -> (uint8 [M, K / 2], e4m3 [M, K / 16], fp32 [M]): one launch."""
    m, k = x.shape
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 16, dtype=torch.float8_e4m3fn, device=x.device)
    g = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        groups = next_power_of_2(k // 16)
        _quant_nvfp4_kernel[(m,)](x, q, s, g, k, x.stride(0), q.stride(0), s.stride(0), GROUPS=groups,
                                  num_warps=4 if groups <= 64 else 8)
    return q, s, g


@triton.jit
def _fp4_scaled_gemm_kernel(
    a_ptr, as_ptr, ag_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BM) · cdiv(N, BN),): out = (A · as · ag) @ (W · ws · wg).T (+ bias), A and W NVFP4."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # GROUP_M row tiles walk the column tiles together (L2 reuse of W)
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a, rows_w = offs_m % M, offs_n % N
    KB: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    offs_b = tl.arange(0, KB)
    offs_g = tl.arange(0, G)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_b[None, :]  # [BM, KB]
    w_ptrs = w_ptr + rows_w[:, None].to(tl.int64) * stride_wn + offs_b[None, :]  # [BN, KB]
    as_ptrs = as_ptr + rows_a[:, None].to(tl.int64) * stride_asm + offs_g[None, :]  # [BM, G]
    ws_ptrs = ws_ptr + rows_w[:, None].to(tl.int64) * stride_wsn + offs_g[None, :]  # [BN, G]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            a_s = tl.load(as_ptrs)
            w_s = tl.load(ws_ptrs)
        else:
            b_ok = (offs_b < (K - k0) // 2)[None, :]
            g_ok = (offs_g < (K - k0) // 16)[None, :]
            a = tl.load(a_ptrs, mask=b_ok, other=0)
            w = tl.load(w_ptrs, mask=b_ok, other=0)
            a_s = tl.load(as_ptrs, mask=g_ok, other=0.0)
            w_s = tl.load(ws_ptrs, mask=g_ok, other=0.0)
        if NATIVE:
            acc = tl.dot_scaled(a, a_s, "e2m1", tl.trans(w), w_s, "e2m1", acc)
        else:  # the interpreter: the same operands dequantized, fp32 dot
            a_f = dequant_bytes(a, _per_byte(a_s, BLOCK_M, G), tl.float32)
            w_f = dequant_bytes(w, _per_byte(w_s, BLOCK_N, G), tl.float32)
            acc += tl.dot(a_f, tl.trans(w_f), input_precision="ieee")
        a_ptrs += KB
        w_ptrs += KB
        as_ptrs += G
        ws_ptrs += G
    acc = acc * tl.load(ag_ptr + rows_a)[:, None] * tl.load(wg_ptr + rows_w)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _per_byte(s, R: tl.constexpr, G: tl.constexpr):
    """Scales [R, G] -> [R, 8G], each group's scale over its 8 bytes (16 codes)."""
    return tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (R, G, 8)), [R, G * 8])


def gemm_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The ``fp4_blackwell`` entry for (N, K) (small tiles under the interpreter)."""
    cfg = tuning.kernel_config(TUNING_PACKAGE, KERNEL, f"n{n}_k{k}", DEFAULTS, device if on_gpu(device) else None)
    if not on_gpu(device):
        return {**cfg, **_CPU}
    return cfg


def fp4_scaled_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] quantized to NVFP4, then the scaled-dot GEMM against W -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w_packed.shape[0]
    cfg = {**gemm_config(m, n, k, x.device), **(config or {})}
    cfg.pop("w4a4", None)
    aq, a_s, ag = quantize_act_nvfp4(x)
    out = x.new_empty(m, n)
    if m == 0:
        return out
    w_packed = w_packed if w_packed.stride(-1) == 1 else w_packed.contiguous()
    w_scale = w_scale if w_scale.stride(-1) == 1 else w_scale.contiguous()
    native = OFFLINE_NATIVE or x.device.type == "cuda"
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _fp4_scaled_gemm_kernel[grid](
        aq, a_s, ag, w_packed, w_scale, global_scale, bias if bias is not None else out, out, m, n, k,
        aq.stride(0), a_s.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, NATIVE=native, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def fp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``interfaces.Fp4Linear`` on Blackwell: the weight-only skinny GEMM up to 64 rows, else W4A4 on the FP4 MMA."""
    check_weight(x, w_packed, w_scale, global_scale)
    if x.shape[0] == 0:
        return x.new_empty(0, w_packed.shape[0])
    if x.shape[0] <= DECODE_MAX_ROWS and not (config or {}).get("prefill", False):
        return fp4_skinny_gemm(x, w_packed, w_scale, global_scale, bias)
    cfg = {key: v for key, v in (config or {}).items() if key != "prefill"}
    m, k = x.shape
    if not {**gemm_config(m, w_packed.shape[0], k, x.device), **cfg}["w4a4"]:  # the Hopper tile kernels, W4A16
        return fp4_prefill_gemm(x, w_packed, w_scale, global_scale, bias)
    return fp4_scaled_gemm(x, w_packed, w_scale, global_scale, bias, cfg)
