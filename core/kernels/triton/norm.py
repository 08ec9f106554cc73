"""RMSNorm on Triton: plain, fused with the residual add, and gated (silu) by groups; float32 statistics.

Same math as armillary.kernels.norm. ``fused_add_rms_norm`` rounds ``x + residual`` to the input
dtype first and normalises that rounded sum, which is what the unfused model computes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary.kernels"


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    dim,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r,
    stride_g_outer,
    stride_g_inner,
    weight_groups,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows of ``dim`` elements; x row r sits at (r // rows_inner, r % rows_inner) of a 3-D view.

    The weight index of row r is (r % weight_groups) * dim + column (gated norm groups).
    """
    pdl_prologue(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    rows64 = rows.to(tl.int64)
    x_off = (rows64 // rows_inner) * stride_x_outer + (rows64 % rows_inner) * stride_x_inner
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed = x + tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = summed.to(res_out_ptr.dtype.element_ty)  # the residual stream keeps the model dtype
        tl.store(res_out_ptr + rows64[:, None] * dim + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    if HAS_GATE:
        g_off = (rows64 // rows_inner) * stride_g_outer + (rows64 % rows_inner) * stride_g_inner  # same view as x
        gate = tl.load(gate_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = gate * tl.sigmoid(gate)
        if not NORM_BEFORE_GATE:
            x = x * gate
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)  # [ROWS]
    w_off = (rows % weight_groups) * dim
    w = tl.load(w_ptr + w_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = x * rstd[:, None] * w
    if HAS_GATE:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(out_ptr + rows64[:, None] * dim + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows_inner, outer stride, inner stride) addressing x's rows without a copy, or raise."""
    if x.stride(-1) != 1:
        raise ValueError("rms_norm: the normalised dim must have unit stride")
    if x.dim() == 1:
        return 1, x.shape[-1], 0
    if x.dim() == 2:
        return 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[1], x.stride(0), x.stride(1)
    raise ValueError("rms_norm: x must be 1-, 2- or 3-dimensional")


def launch_config(block_d: int, device: torch.device | None = None) -> dict:
    """Rows per program and warps for a padded row width ``block_d``: defaults, then the tables."""
    rows = max(1, min(16, 2048 // block_d))
    defaults = {"ROWS": rows, "num_warps": 4 if block_d * rows <= 4096 else 8}
    return kernel_config(TUNING_PACKAGE, "rms_norm", f"d{block_d}", defaults, device)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    group: int | None = None,
    norm_before_gate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, dim = x.shape, x.shape[-1]
    if residual is not None and x.dim() != 2:
        raise ValueError("fused_add_rms_norm: x must be [N, D]")
    if gate is not None and (gate.shape != x.shape or x.dim() not in (2, 3)):
        raise ValueError("gated_rms_norm: x and gate must be [N, D] or [T, H, D] of one shape")
    if gate is not None and group is not None and group != dim:
        if not (x.is_contiguous() and gate.is_contiguous()):
            raise ValueError("gated_rms_norm with groups needs contiguous x and gate")
        x, gate = x.view(-1, group), gate.view(-1, group)
        dim, weight_groups = group, weight.numel() // group
    else:
        weight_groups = 1
    rows_inner, stride_outer, stride_inner = _rows_view(x)
    num_rows = x.numel() // dim
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if residual is not None and (residual.stride(-1) != 1 or residual.dim() != 2 or residual.shape != x.shape):
        raise ValueError("fused_add_rms_norm: residual must be [T, D] like x with unit last stride")
    if gate is not None and gate.stride(-1) != 1:
        raise ValueError("gated_rms_norm: gate must have unit last stride")
    _, g_outer, g_inner = _rows_view(gate) if gate is not None else (1, 0, 0)
    if num_rows == 0:
        return out.view(shape), res_out
    block_d = next_power_of_2(dim)
    cfg = launch_config(block_d, x.device)
    _rms_norm_kernel[(cdiv(num_rows, cfg["ROWS"]),)](
        x, residual if residual is not None else x, gate if gate is not None else x, weight, out,
        res_out if res_out is not None else out, num_rows, dim, rows_inner, stride_outer, stride_inner,
        residual.stride(0) if residual is not None else 0, g_outer, g_inner, weight_groups, float(eps), HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        NORM_BEFORE_GATE=norm_before_gate, ZERO_CENTERED=zero_centered, ROWS=cfg["ROWS"], BLOCK_D=block_d,
        num_warps=cfg["num_warps"], **launch_options(x.device),
    )  # fmt: skip
    return out.view(shape), res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x̂ · w, or x̂ · (1 + w) when ``zero_centered``. x: [D], [N, D] or [T, H, D] (strided views
    allowed, unit last stride); weight: [D]. Returns a contiguous tensor of x's shape and dtype."""
    return _launch(x, weight, eps, zero_centered)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (rounded to the dtype); returns (rms_norm(new_residual), new_residual).

    x, residual: [T, D] (unit last stride); weight: [D]. Both outputs are new contiguous tensors.
    """
    normed, new_residual = _launch(x, weight, eps, zero_centered, residual=residual)
    assert new_residual is not None
    return normed, new_residual


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """RMSNorm gated by silu(gate) over ``group_size`` slices: armillary.kernels.norm.gated_rms_norm.

    x, gate: [N, D] or [T, H, D] of one shape (strided views allowed, unit last stride; contiguous
    when grouped); weight: [D] (not zero-centred). Returns a contiguous tensor of x's shape.
    """
    if group_size is not None and x.shape[-1] % group_size:
        raise ValueError(f"gated_rms_norm: dim {x.shape[-1]} is not a multiple of group_size {group_size}")
    return _launch(x, weight, eps, False, gate=gate, group=group_size, norm_before_gate=norm_before_gate)[0]
