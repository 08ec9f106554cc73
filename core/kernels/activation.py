"""Activation functions by config name, and the gated (``act(gate) * up``) forms MLPs use."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)²: Nemotron-H's expert activation."""
    return torch.square(F.relu(x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_BY_NAME: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "relu": F.relu,
    "relu2": relu_squared,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config's ``hidden_act`` names (transformers' ACT2FN spelling)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_BY_NAME)}") from None


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Gated activation over a fused projection. x: [..., 2I] = [gate | up] -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return get_activation(activation)(gate).mul_(up)  # in place on the activation's fresh output


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x: [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    return act_and_mul(x, "silu")
