"""RMS normalisation, plain and gated: the reference implementations (float32 math, input dtype out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x̂ · w, or x̂ · (1 + w) when ``zero_centered`` (Qwen3-Next / Qwen3.5 / Gemma store w around 0).

    x: [..., D]; weight: [D]. Normalises over the last dim in float32; returns x's dtype.
    """
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # a new tensor: x itself is never written
    w = weight.float()
    if zero_centered:
        w = w + 1.0
    return out.mul_(w).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """RMSNorm gated by silu(gate), normalising each ``group_size`` slice of the last dim on its own.

    x, gate: [..., D]; weight: [D] (not zero-centred). ``norm_before_gate``: x̂ · w · silu(gate)
    (Qwen3 GDN output norm); otherwise norm(x · silu(gate)) · w (Mamba-2). ``group_size`` None
    means one group of D. Float32 math, returns x's dtype.
    """
    d = x.shape[-1]
    group = group_size or d
    if d % group:
        raise ValueError(f"gated_rms_norm: dim {d} is not a multiple of group_size {group}")
    xf, gf = x.float(), gate.float()
    if not norm_before_gate:
        xf = xf * F.silu(gf)
    grouped = xf.reshape(*xf.shape[:-1], d // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = grouped.reshape(xf.shape) * weight.float()
    if norm_before_gate:
        out = out * F.silu(gf)
    return out.to(x.dtype)
