"""Rotary inverse frequencies per Gemma layer type: default, linear-scaled, or proportional (Gemma 4).

Proportional RoPE (Gemma 4's global layers) rotates only the first ``partial_rotary_factor · D / 2``
frequency pairs but keeps the exponents of the full head dim; the other pairs get frequency 0
(cos 1, sin 0), so rotating the whole head with neox pairing (i, i + D/2) is exactly transformers'.
"""
from __future__ import annotations

import torch

from armillary_gemma.config import RopeArgs


def gemma_inv_freq(args: RopeArgs, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies on the current default device."""
    device = torch.get_default_device()
    if args.rope_type == "proportional":
        angles = int(args.partial_rotary_factor * head_dim // 2)
        inv = 1.0 / (args.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=device) / head_dim))
        inv = torch.cat((inv, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)))
        return inv / args.factor
    inv = 1.0 / (args.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return inv / args.factor if args.rope_type == "linear" else inv
