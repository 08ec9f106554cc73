"""Rotary inverse frequencies of the MLA rope dims (default or yarn) and yarn's cos / sin attention factor."""
from __future__ import annotations

import math

import torch

from armillary.kernels.rotary import rotary_inv_freq
from armillary_glm_flash.config import RopeSpec, yarn_mscale


def rope_inv_freq(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] float32, the factor cos and sin are multiplied by), as transformers computes them."""
    if spec.type == "default":
        return rotary_inv_freq(dim, spec.theta), 1.0
    factor = spec.factor
    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = yarn_mscale(factor, spec.mscale) / yarn_mscale(factor, spec.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        wavelengths = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)
