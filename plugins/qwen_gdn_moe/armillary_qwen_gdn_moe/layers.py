"""Small building blocks shared by the Qwen GDN models: linears, norms, the SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from armillary.kernels.activation import get_activation
from armillary.kernels import ops


class Linear(nn.Linear):
    """``nn.Linear`` (same ``weight`` / ``bias``) whose forward is ``ops.linear``: the Triton skinny GEMM
    for decode-sized batches on the GPU where it beats cuBLAS, ``F.linear`` otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """A :class:`Linear` on the current default device with uninitialised weights (load_weights fills them)."""
    return skip_init(Linear, in_features, out_features, bias=bias, device=torch.get_default_device())


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    return skip_init(nn.Embedding, num_embeddings, dim, device=torch.get_default_device())


def empty_parameter(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ZeroCenteredRMSNorm(nn.Module):
    """x̂ · (1 + w): every RMSNorm of these models except the GDN output norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, zero_centered=True)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), fused on the GPU."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, zero_centered=True)


class GatedRMSNorm(nn.Module):
    """x̂ · w · silu(z) per head: the GDN output norm (weight not offset)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(act(gate(x)) · up(x)): the dense MLP and the MoE shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
