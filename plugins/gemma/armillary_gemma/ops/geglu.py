"""GeGLU in one Triton launch: ``gelu_tanh(gate) · up`` over the fused gate/up projection's output.

Gemma's dense MLP (and its MoE experts) use the tanh GELU; unfused that is a chunk, a GELU and a
multiply, three passes over ``[T, 2I]``. gelu_tanh(x) = x · sigmoid(2·√(2/π)·(x + 0.044715·x³)),
computed in float32. The reference is ``naive.gelu_tanh_and_mul_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.tuning import kernel_config

DEFAULTS = {"any": {"BLOCK": 1024, "num_warps": 4}}


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows, cdiv(I, BLOCK)): out[r, c] = gelu_tanh(x[r, c]) · x[r, I + c]."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # 2·sqrt(2/pi) as a literal: Triton's compiler rejects a kernel reading a plain-float module global
    inner = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    out = gate * tl.sigmoid(inner) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (unit last stride) -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"gelu_tanh_and_mul: x must be [T, 2I] with unit last stride, got {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg = kernel_config("armillary_gemma", "gelu_tanh_and_mul", "any", DEFAULTS["any"], x.device)
    block = min(cfg["BLOCK"], next_power_of_2(inter))
    _gelu_tanh_and_mul_kernel[(rows, cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0),
                                                                 BLOCK=block, num_warps=cfg["num_warps"],
                                                                 **launch_options(x.device))
    return out
