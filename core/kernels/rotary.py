"""Rotary position embedding (RoPE), full or partial, neox (rotate-half) or interleaved pairs."""
from __future__ import annotations

import torch


def rotary_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / rotary_dim)``: [rotary_dim // 2] float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta**exponents)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> (cos, sin), each [T, rotary_dim // 2] float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[-1]`` dims of each head; the rest pass through.

    x: [T, H, D]; cos, sin: [T, rotary_dim // 2]. Neox style (default) pairs dim i with
    i + rotary_dim/2; ``interleaved`` pairs 2i with 2i+1 (GLM / DeepSeek MLA). Float32 math,
    returns x's dtype.
    """
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    if interleaved:
        rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((rotated.to(x.dtype), rest), dim=-1)
    # neox: each half written in place into one float32 buffer (no concatenations; same roundings)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    o1, o2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, c, out=o1).sub_(x2 * s)
    torch.mul(x2, c, out=o2).add_(x1 * s)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]  # partial rotary: the rest passes through unchanged
    return out.to(x.dtype)
