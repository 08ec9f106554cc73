"""Gemma's final logit soft-cap in one Triton launch: ``cap · tanh(logits / cap)`` in float32 from the head's output.

Unfused that is four passes over ``[N, V]`` (262K columns): the cast to float32, the division, the
tanh and the product. tanh(y) = 2·sigmoid(2y) − 1, as the attention kernels' soft-cap computes it.
The reference is ``naive.softcap_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops
from armillary.kernels.triton.host import cdiv

BLOCK = 2048


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, cols, stride_x, cap, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(cols, BLOCK)): out [rows, cols] float32, contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    y = (2.0 * tl.sigmoid(2.0 * (x / cap)) - 1.0) * cap
    tl.store(out_ptr + row * cols + offs, y, mask=ok)


def softcap_triton(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """logits: [N, V] (unit last stride, any float dtype) -> float32 [N, V] soft-capped."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"softcap: logits must be [N, V] with unit last stride, got {tuple(logits.shape)}")
    rows, cols = logits.shape
    out = torch.empty(rows, cols, dtype=torch.float32, device=logits.device)
    if rows and cols:
        _softcap_kernel[(rows, cdiv(cols, BLOCK))](logits, out, cols, logits.stride(0), float(cap),
                                                          BLOCK=BLOCK, num_warps=4)
    return out


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """float32 logits, soft-capped when ``cap``: one launch on Triton, the torch ops elsewhere."""
    if not cap:
        return logits.float()
    if ops.use_triton(logits):
        return softcap_triton(logits, cap)
    return torch.tanh(logits.float() / cap) * cap
