"""Prefill FP8 linears on cuBLASLt's block-scaled GEMM (``torch._scaled_mm``, 1x128 activation / 128x128 weight scales) where the running torch and GPU have it.

What torch 2.11 accepts (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``get_joint_scaling`` for the
pair (BlockWise1x128, BlockWise128x128); cuBLASLt >= 12.9 on sm_90 only):

- ``a`` fp8 [M, K] row-major and ``b`` fp8 [K, N] column-major (our weight [N, K] as ``w.t()``),
  K and N multiples of 16; the output dtype bf16 / fp16 (a bias must be that dtype);
- ``scale_a`` fp32 [M, K / 128] *outer-dim-major*: strides (1, M), i.e. the transpose of a
  contiguous [K / 128, M], which is exactly what ``fp8_gemm.quantize_act`` writes;
- ``scale_b`` fp32 [K / 128, N / 128] whose transpose is row-major [N / 128, K / 128] with stride
  K / 128: the checkpoint's contiguous ``weight_scale_inv`` as ``s.t()``. cuBLAS wants that
  leading dimension padded to 4 (16 bytes) and the v1 op takes no padding, so K / 128 must be a
  multiple of 4;
- scales are dequantization multipliers (``x ≈ q · s``), as ours; an unsupported layout or GPU is
  a ``RuntimeError`` ("Invalid scaling configuration", "only supported ... SM90").

Routing is decided by shape rules (``fits``) and once per device by ``ready``: sm_90, and a probe
GEMM whose scales vary strongly per block, compared against the dequantizing reference (a wrong
layout is off by O(1), a right one by bf16 rounding). Rows are padded to ``ROW_ALIGN`` (the
quantizer writes zero rows) so every scale stride is 16-byte aligned; the output is the first M
rows of the padded result (a contiguous view). ``ARMILLARY_FP8_SCALED_MM=0`` turns the route off.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from armillary.kernels import fp8 as ref

log = logging.getLogger("armillary")

BLOCK = 128  # the only block size cuBLAS scales by
MIN_ROWS = 128  # prefill calls with more rows than this take cuBLAS (the Triton GEMM below)
# a weight with rows past its last whole 128-row block takes cuBLAS (those rows on the Triton GEMM) from this
# many rows: on the H200 at N 12352, K 2048 the split ran 129.5 / 208.4 / 373.0 / 726.5 us against the Triton
# GEMM's 184.8 / 354.4 / 694.4 / 1401.0 at 2K / 4K / 8K / 16K rows (bench/fp8_prefill_paths.py; an earlier,
# rougher check had 231 against 191 at 2K and 223 against 144 at 200 rows)
PARTIAL_MIN_ROWS = 2048
ROW_ALIGN = 16  # rows padded to this: scale_a's stride M stays a multiple of 16 bytes
PROBE_TOLERANCE = 1e-2  # relative error vs the reference; bf16 output rounding alone is ~2e-3
_READY: dict[tuple[str, int | None], bool] = {}
_WHY: dict[tuple[str, int | None], str] = {}  # the decision's reason, per device (``status``)


def padded_rows(m: int) -> int:
    return -(-m // ROW_ALIGN) * ROW_ALIGN


def fits(m: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
         min_rows: int = MIN_ROWS) -> bool:
    """Shape and layout rules of the cuBLAS route (no device state): 128 x 128 blocks, K a multiple of
    512 (K / 128 scales a multiple of 4), N whole 128-row blocks (or, from PARTIAL_MIN_ROWS rows, at least one:
    fp8_linear runs the rows past the last whole block on the Triton GEMM), bf16 / fp16 activations,
    contiguous weight and scales."""
    n, k = weight.shape
    whole = n % BLOCK == 0 or (n >= BLOCK and m >= PARTIAL_MIN_ROWS)
    return (m > min_rows and block_n == BLOCK and block_k == BLOCK and k % (4 * BLOCK) == 0 and whole
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == ref.FP8_DTYPE
            and weight.is_contiguous() and scale.dtype == torch.float32 and scale.is_contiguous()
            and scale.shape == (-(-n // BLOCK), k // BLOCK))


def operands(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
             scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, scale_a, scale_b) for ``torch._scaled_mm`` from the quantizer's xq [Mp, K] e4m3 and xs
    [K / 128, Mp] fp32 (group-major) and the weight [N, K] e4m3 with scales [N / 128, K / 128]."""
    mp, k = xq.shape
    n = weight.shape[0]
    if xs.shape != (k // BLOCK, mp) or not xs.is_contiguous():
        raise ValueError(f"fp8 scaled_mm: activation scales {tuple(xs.shape)} must be contiguous [{k // BLOCK}, {mp}]")
    if scale.shape != (n // BLOCK, k // BLOCK) or not scale.is_contiguous():
        raise ValueError(f"fp8 scaled_mm: weight scales {tuple(scale.shape)} must be contiguous "
                         f"[{n // BLOCK}, {k // BLOCK}]")
    return xq, weight.t(), xs.t(), scale.t()  # [Mp, K], [K, N] col-major, [Mp, K/128] (1, Mp), [K/128, N/128]


def matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``m`` rows of ``dequant(xq) @ dequant(weight).T (+ bias)`` on cuBLASLt: [m, N] in out_dtype.
    ``out``: an [Mp, N] view (unit last stride, any row stride: cuBLAS writes it in place, measured no slower
    on the H200) to write all padded rows into."""
    a, b, sa, sb = operands(xq, xs, weight, scale)
    fused_bias = bias if bias is not None and bias.dtype == out_dtype else None
    if out is None:
        result = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=fused_bias, out_dtype=out_dtype)
    else:
        result = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=fused_bias, out_dtype=out_dtype, out=out)
    if bias is not None and fused_bias is None:
        result += bias.to(out_dtype)
    return result[:m]


def emulate(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """What ``_scaled_mm`` computes from (1x128, 128x128) operands, in fp32 torch (any device):
    out[i, j] = Σ_g scale_a[i, g] · scale_b[g, j // 128] · Σ_{k in g} a[i, k] · b[k, j]."""
    k = a.shape[1]
    sa = scale_a.repeat_interleave(BLOCK, dim=1)[:, :k]  # [M, K]
    sb = scale_b.repeat_interleave(BLOCK, dim=0)[:k].repeat_interleave(BLOCK, dim=1)[:, : b.shape[1]]  # [K, N]
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


def probe(device: torch.device, quantize: Callable, run: Callable = matmul, m: int = 200) -> tuple[bool, str]:
    """One GEMM through ``run`` (``m`` rows, N = 384, K = 512, scales spanning 2^-8..2^8 per block)
    against ``ref.linear_w8a8``: (ok, why)."""
    gen = torch.Generator(device=device).manual_seed(13)
    n, k = 3 * BLOCK, 4 * BLOCK
    spread = torch.exp2(torch.randint(-8, 9, (n // BLOCK, k // BLOCK), generator=gen, device=device).float())
    w = torch.randn(n, k, generator=gen, device=device) * ref.expand_scale(spread, n, k, BLOCK, BLOCK)
    wq, ws = ref.quantize_blocks(w, BLOCK, BLOCK)
    x = (torch.randn(m, k, generator=gen, device=device)
         * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen, device=device).float())).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    try:
        xq, xs = quantize(x, BLOCK, padded_rows(m))
        got = run(xq, xs, wq, ws, bias, torch.bfloat16, m)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    want = ref.linear_w8a8(x, wq, ws, BLOCK, BLOCK, bias)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if got.shape != want.shape or not err < PROBE_TOLERANCE:
        return False, f"probe result off the reference: shape {tuple(got.shape)}, relative error {err:.3g}"
    return True, f"relative error {err:.2e}"


def status(device: torch.device) -> str:
    """Why the route is on or off for ``device`` (after ``ready`` decided)."""
    key = (device.type, device.index)
    return f"{'on' if _READY.get(key) else 'off'}: {_WHY.get(key, 'not decided yet')}"


def ready(device: torch.device, quantize: Callable) -> bool:
    """Whether this device takes the route: sm_90 with ``torch._scaled_mm`` and a passing probe, decided
    once per device (never during a CUDA-graph capture: the probe syncs, so a capture gets False then)."""
    key = (device.type, device.index)
    if key in _READY:
        return _READY[key]
    if device.type != "cuda" or os.environ.get("ARMILLARY_FP8_SCALED_MM", "1") == "0" \
            or not hasattr(torch, "_scaled_mm"):
        _READY[key], _WHY[key] = False, "not a CUDA device, no torch._scaled_mm, or ARMILLARY_FP8_SCALED_MM=0"
        return False
    if torch.cuda.is_current_stream_capturing():
        return False  # undecided: ask again outside the capture
    if torch.cuda.get_device_capability(device) != (9, 0):
        _READY[key], _WHY[key] = False, f"compute capability {torch.cuda.get_device_capability(device)}, not (9, 0)"
        log.info("fp8 prefill: torch._scaled_mm block scaling is sm_90 only; the Triton GEMM serves %s", device)
        return False
    ok, why = probe(device, quantize)
    _READY[key], _WHY[key] = ok, f"probe: {why}"
    log.info("fp8 prefill on %s: %s (%s)", device, "cuBLAS block-scaled _scaled_mm" if ok else "Triton GEMM", why)
    return ok
