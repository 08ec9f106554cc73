"""The Mamba-2 prefill's grouped gated RMSNorm, norm(y · silu(z)) · w per group, reading z in place as a column view of in_proj's output.

Core's grouped ``gated_rms_norm`` wants both operands contiguous, which costs the prefill a copy
of z (at 16K tokens a 134 MB strided copy per Mamba layer). Here a program owns ``ROWS`` tokens of
one norm group and reads y and z through their own row strides. Float32 math, the output in y's
dtype; reference: core's ``armillary.kernels.norm.gated_rms_norm(norm_before_gate=False)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary_nemotron"
NORM_DEFAULTS = {"ROWS": 4, "num_warps": 4}


@triton.jit
def _gated_group_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, num_rows, stride_y, stride_z, stride_o, eps,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK_G)
    m_g = tl.arange(0, BLOCK_G) < GROUP
    mask = (rows < num_rows)[:, None] & m_g[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    y = tl.load(y_ptr + rows64 * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [R, G]
    z = tl.load(z_ptr + rows64 * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gated = y * z * tl.sigmoid(z)
    inv = tl.rsqrt(tl.sum(gated * gated, axis=1) / GROUP + eps)  # [R]
    w = tl.load(w_ptr + cols, mask=m_g, other=0.0).to(tl.float32)
    out = gated * inv[:, None] * w[None, :]
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                     config: dict | None = None) -> torch.Tensor:
    """y, z [T, D] (any row strides, unit column stride), weight [D] -> norm(y · silu(z)) · w per
    ``group_size`` channels, a new contiguous [T, D] in y's dtype."""
    num_rows, dim = y.shape
    if z.shape != y.shape or weight.shape != (dim,) or dim % group_size:
        raise ValueError(f"gated_group_norm: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)} "
                         f"do not fit groups of {group_size}")
    if y.stride(1) != 1 or z.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gated_group_norm: y and z need unit column stride, weight contiguous")
    out = torch.empty(num_rows, dim, dtype=y.dtype, device=y.device)
    if num_rows == 0:
        return out
    block_g = next_power_of_2(group_size)
    cfg = {**kernel_config(TUNING_PACKAGE, "mamba_gated_norm", f"g{block_g}", NORM_DEFAULTS, y.device),
           **(config or {})}
    grid = (cdiv(num_rows, cfg["ROWS"]), dim // group_size)
    _gated_group_norm_kernel[grid](y, z, weight, out, num_rows, y.stride(0), z.stride(0), out.stride(0), float(eps),
                                   GROUP=group_size, BLOCK_G=block_g, ROWS=cfg["ROWS"], num_warps=cfg["num_warps"])
    return out
