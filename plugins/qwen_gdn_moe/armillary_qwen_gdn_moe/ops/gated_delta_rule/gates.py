"""Gated DeltaNet's per-token gates in one Triton launch for prefill chunks: beta = sigmoid(b) and the
log decay g = -exp(A_log) · softplus(a + dt_bias), from the in_proj output's b and a columns.

In plain torch these are six elementwise launches per layer (sigmoid, cast, add, softplus, exp,
multiply); a short prefill chunk is host-bound, so launches are what it pays for.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from armillary.kernels.triton.host import cdiv, next_power_of_2


@triton.jit
def _gates_kernel(b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, beta_ptr, g_ptr, num_tokens, stride_b, stride_a,
                  HV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < num_tokens) & (heads[None, :] < HV)
    t = rows[:, None].to(tl.int64)
    b = tl.load(b_ptr + t * stride_b + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * stride_a + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a_dt = a + tl.load(dt_bias_ptr + heads, mask=heads < HV, other=0.0)[None, :]
    softplus = tl.where(a_dt > 20.0, a_dt, tl.log(1.0 + tl.exp(a_dt)))  # torch's threshold of 20
    g = -tl.exp(tl.load(a_log_ptr + heads, mask=heads < HV, other=0.0))[None, :] * softplus
    out = t * HV + heads[None, :]
    tl.store(beta_ptr + out, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)
    tl.store(g_ptr + out, g, mask=mask)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              block_t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a: [T, HV] (column views of in_proj's output: unit stride along heads); A_log, dt_bias: [HV] fp32.

    Returns (beta [T, HV] in b's dtype, g [T, HV] fp32), as ``torch.sigmoid(b)`` and
    ``-A_log.exp() * F.softplus(a.float() + dt_bias)``."""
    num_tokens, heads = b.shape
    if a.shape != b.shape or b.stride(1) != 1 or a.stride(1) != 1 or A_log.shape != (heads,) \
            or dt_bias.shape != (heads,):
        raise ValueError(f"gdn_gates: b {tuple(b.shape)} a {tuple(a.shape)} A_log {tuple(A_log.shape)} "
                         f"dt_bias {tuple(dt_bias.shape)} do not fit [T, HV] with unit head stride")
    beta = torch.empty(num_tokens, heads, dtype=b.dtype, device=b.device)
    g = torch.empty(num_tokens, heads, dtype=torch.float32, device=b.device)
    if num_tokens:
        _gates_kernel[(cdiv(num_tokens, block_t),)](
            b, a, A_log, dt_bias, beta, g, num_tokens, b.stride(0), a.stride(0),
            HV=heads, BLOCK_T=block_t, BLOCK_H=next_power_of_2(heads), num_warps=4,
        )
    return beta, g
