"""In-place rotary embedding of q and k on Triton, full or partial (rotary_dim < head_dim), neox or interleaved.

Same math as armillary.kernels.rotary.apply_rotary: float32 rotation, rounded to the input dtype;
dims past rotary_dim are not touched. cos / sin come either per token ([T, rotary_dim / 2]) or
from a cache indexed by position ([max_pos, rotary_dim] rows [cos | sin], see rotary_cos_sin_cache).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.rotary import rotary_cos_sin
from armillary.kernels.triton.host import next_power_of_2


@triton.jit
def _rotate_heads(ptr, token, stride_t, stride_h, num_heads, cos, sin, half, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (j < half)[None, :]
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + half
    base = ptr + token * stride_t + heads[:, None] * stride_h
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + first[None, :], (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(base + second[None, :], (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads,
    num_k_heads,
    half,
    HAS_POSITIONS: tl.constexpr,
    HAS_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(pos_ptr + token).to(tl.int64)
    else:
        row = token
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + row * stride_cs + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + row * stride_cs + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, half, INTERLEAVED, BLOCK_HQ, BLOCK_HALF)
    if HAS_K:
        _rotate_heads(k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, half, INTERLEAVED, BLOCK_HK, BLOCK_HALF)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    half: int,
    interleaved: bool,
) -> None:
    for name, t in (("q", q), ("k", k)):
        if t is not None and (t.dim() != 3 or t.stride(2) != 1 or 2 * half > t.shape[2]):
            raise ValueError(f"rotary: {name} must be [T, heads, head_dim >= rotary_dim] with unit last stride")
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    k_arg = k if k is not None else q
    _rotary_kernel[(num_tokens,)](
        q, k_arg, positions if positions is not None else cos, cos, sin, cos.stride(0),
        q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1), q.shape[1], k_arg.shape[1], half,
        HAS_POSITIONS=positions is not None, HAS_K=k is not None, INTERLEAVED=interleaved,
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k_arg.shape[1]),
        BLOCK_HALF=next_power_of_2(half), num_warps=4 if q.shape[1] * half >= 1024 else 2,
    )  # fmt: skip


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> None:
    """Rotate q (and k) in place with per-token cos, sin: [T, rotary_dim // 2] (float32, unit last stride).

    q: [T, Hq, D]; k: [T, Hk, D] or None; views with strided tokens / heads are fine.
    """
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("rotary: cos and sin must have the same shape and strides, unit last stride")
    _launch(q, k, None, cos, sin, cos.shape[-1], interleaved)


def rotary_embedding_(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Rotate q (and k) in place at ``positions`` ([T] int) from a [max_pos, rotary_dim] [cos | sin] cache."""
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary: cos_sin_cache must be [max_pos, rotary_dim] with unit last stride")
    half = cos_sin_cache.shape[1] // 2
    _launch(q, k, positions, cos_sin_cache, cos_sin_cache[:, half:], half, interleaved)


def rotary_cos_sin_cache(max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_positions, rotary_dim] float32 rows [cos | sin] for positions 0..max_positions-1."""
    cos, sin = rotary_cos_sin(torch.arange(max_positions, device=inv_freq.device), inv_freq)
    return torch.cat((cos, sin), dim=-1).contiguous()
