"""Depthwise causal conv1d over packed variable-length sequences, continuing from a per-slot state.

Used by Gated DeltaNet (Qwen3-Next / Qwen3.5) and Mamba-2 mixers. The state of a sequence is its
last ``kernel - 1`` inputs, kept in ``conv_states[slot]: [C, kernel - 1]``; a fresh slot is zeros,
which is the same as left zero-padding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from armillary.kernels.activation import get_activation


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """out[t, c] = act(bias[c] + sum_j weight[c, j] · input[t - (K-1) + j, c]) per sequence.

    x: [T, C] packed new inputs; weight: [C, K]; bias: [C] or None;
    conv_states: [num_slots, C, K-1], read as each sequence's preceding inputs and updated in
    place with its last K-1 inputs; state_indices: [B] slot per sequence; cu_seqlens: B+1
    offsets into x (host ints or a tensor). Float32 math; returns [T, C] in x's dtype.
    """
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    channels, kernel = weight.shape
    act = get_activation(activation) if activation else None
    w = weight.float()[:, None, :]  # [C, 1, K]
    b = bias.float() if bias is not None else None
    out = torch.empty_like(x)
    slots = state_indices.tolist()
    for seq, slot in enumerate(slots):
        start, end = bounds[seq], bounds[seq + 1]
        if end == start:
            continue  # nothing new: the state stays as it is
        window = torch.cat((conv_states[slot].to(x.dtype), x[start:end].transpose(0, 1)), dim=1)  # [C, K-1+n]
        y = F.conv1d(window.float()[None], w, b, groups=channels)[0]  # [C, n]
        if act is not None:
            y = act(y)
        out[start:end] = y.transpose(0, 1).to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - (kernel - 1) :].to(conv_states.dtype)
    return out
