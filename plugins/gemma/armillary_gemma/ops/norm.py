"""Gemma's sandwich norms in one Triton launch: ``r' = r + norm1(h)``, then ``norm2(r')``.

Every Gemma layer normalises a sublayer's output before adding it to the residual stream and
normalises the sum again for the next sublayer (post-attention norm, then pre-feedforward norm;
post-feedforward norm, then the next layer's input norm): two launches and two passes over the
row in core's ops, one here. Roundings follow the unfused torch ops: norm1's output, the sum and
norm2's output are each rounded to the model dtype. The reference is ``naive.norm_add_norm_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops
from armillary.kernels.triton.host import next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue


@triton.jit
def _norm_add_norm_kernel(h_ptr, r_ptr, w1_ptr, w2_ptr, out_ptr, r_out_ptr, dim, stride_h, stride_r, eps,
                          ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w1_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w2_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w1, w2 = w1 + 1.0, w2 + 1.0
    dtype = r_out_ptr.dtype.element_ty
    n1 = (h * tl.rsqrt(tl.sum(h * h, 0) / dim + eps) * w1).to(dtype).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    summed = (r + n1).to(dtype)
    tl.store(r_out_ptr + row * dim + cols, summed, mask=ok)
    s = summed.to(tl.float32)
    out = s * tl.rsqrt(tl.sum(s * s, 0) / dim + eps) * w2
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def norm_add_norm_triton(h: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float,
                         zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h, residual: [T, D] (unit last stride); w1, w2: [D] -> (norm2(r'), r') with r' = residual + norm1(h)."""
    if h.dim() != 2 or h.shape != residual.shape or h.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"norm_add_norm: h {tuple(h.shape)} and residual {tuple(residual.shape)} must be [T, D] rows")
    rows, dim = h.shape
    out, r_out = torch.empty_like(h), torch.empty_like(residual)
    if rows:
        block = next_power_of_2(dim)
        _norm_add_norm_kernel[(rows,)](h, residual, w1, w2, out, r_out, dim, h.stride(0), residual.stride(0), eps,
                                       ZERO_CENTERED=zero_centered, BLOCK=block, num_warps=8 if block >= 4096 else 4,
                                       **launch_options(h.device))
    return out, r_out


def norm_add_norm(h: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float,
                  zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton where the dispatch serves Triton; core's two norm ops elsewhere (the CPU reference path)."""
    if ops.use_triton(h):
        return norm_add_norm_triton(h, residual, w1, w2, eps, zero_centered)
    return ops.add_rms_norm(ops.rms_norm(h, w1, eps, zero_centered), residual, w2, eps, zero_centered)
