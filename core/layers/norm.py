"""RMS norms of every model: plain or zero-centred (x̂ · (1 + w)), fused with the residual add, and gated.

Parameters: ``weight`` [dim] (params dtype), loaded whole from the checkpoint tensor of the same
name. All math in float32, the input dtype out; the GPU path is the Triton kernels of ``ops``.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.kernels import ops


def _weight(dim: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(dim), requires_grad=False)


class RMSNorm(nn.Module):
    """``x̂ · w`` (``zero_centered``: ``x̂ · (1 + w)``, as Qwen3-Next / Gemma store it) over the last dim.

    ``forward(x)`` -> normed x; ``add(x, residual)`` -> ``(norm(x + residual), x + residual)``,
    one fused launch on the GPU: the pre-norm residual stream of a decoder layer.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = _weight(dim)
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum rounded to the model dtype first."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, zero_centered=self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """``norm(x) · w · silu(gate)`` (``norm_before_gate``; else ``norm(x · silu(gate)) · w``), the
    statistics taken per ``group_size`` channels (None: the whole last dim = ``dim``).

    Gated DeltaNet's and Mamba-2's output norm; ``weight`` is not offset. ``forward(x, gate)``:
    x and gate of the same shape [..., dim] (strided [T, H, D] head views are read in place).
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None,
                 norm_before_gate: bool = True) -> None:
        super().__init__()
        self.weight = _weight(dim)
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps, self.group_size, self.norm_before_gate)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}"
