"""Sigmoid output gates in Triton: ``out · sigmoid(gate)`` rounded as the torch ops round it.

Gated attention (Qwen3-Next / Qwen3.5 / Qwen3.6) multiplies each head's output by the sigmoid of a
per-head gate that is a strided view of the q projection. torch runs that as two passes, and its
sigmoid over the strided view takes the non-vectorized elementwise kernel (213 us at 16K tokens x 16
heads x 256 on an H200); one pass here reads both operands once. The decode kernels apply the same
rounding inside their epilogues (``sigmoid_gated``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2


@triton.jit
def sigmoid_gated(out, gate_ptrs, mask):
    """out · sigmoid(gate), rounded as torch rounds ``out * torch.sigmoid(gate)`` (out already in its dtype)."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    sig = tl.sigmoid(gate.to(tl.float32)).to(gate.dtype)
    return (out.to(tl.float32) * sig.to(tl.float32)).to(out.dtype)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, gate_ptr, T, D, stride_xt, stride_xh, stride_gt, stride_gh,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), H): x[t, h] = x[t, h] · sigmoid(gate[t, h]) for BLOCK_T rows of one head."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (t < T) & (d < D)
    ptrs = x_ptr + t * stride_xt + h * stride_xh + d
    x = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, sigmoid_gated(x, gate_ptr + t * stride_gt + h * stride_gh + d, mask), mask=mask)


def sigmoid_gate_(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] *= sigmoid(gate [T, H, D]) in place (both with unit last stride, any other strides); returns x."""
    if x.shape != gate.shape or x.dim() != 3 or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"sigmoid_gate_: x {tuple(x.shape)} and gate {tuple(gate.shape)} must be [T, H, D] alike "
                         "with unit last strides")
    tokens, heads, dim = x.shape
    if tokens == 0:
        return x
    block_d = next_power_of_2(dim)
    block_t = max(1, 4096 // block_d)  # ~4K elements a program
    _sigmoid_gate_kernel[(cdiv(tokens, block_t), heads)](
        x, gate, tokens, dim, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), BLOCK_T=block_t,
        BLOCK_D=block_d, num_warps=4)
    return x
