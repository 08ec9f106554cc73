"""Float32 references of the plugin's Triton kernels (the oracle in tests)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up] -> gelu_tanh(gate) · up [..., I], float32 math, x's dtype out."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def norm_add_norm_ref(h: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float,
                      zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm2(r'), r') with r' = residual + norm1(h): float32 math, each step rounded to h's dtype."""
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = w.float() + 1.0 if zero_centered else w.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)

    summed = (residual.float() + norm(h, w1).float()).to(residual.dtype)
    return norm(summed, w2), summed
