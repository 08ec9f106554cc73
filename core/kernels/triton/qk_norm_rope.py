"""Per-head q/k RMSNorm, partial rotary and the paged K/V store of one attention layer: one launch.

Replaces rms_norm(q), rms_norm(k), rotary(q), rotary(k) and the K/V store. The inputs are views
of the fused qkv projection (no copies); q comes out contiguous, the normed and rotated k and the
raw v go straight into the paged cache at ``slot_mapping`` (the layout of kv_cache.py).

Rounding follows the unfused path (armillary.kernels.norm.rms_norm, then rotary.apply_rotary,
then attention.write_kv): the normed heads are rounded to the input dtype before the float32
rotation, whose result is rounded to the input dtype again, and k is then cast to the cache dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.fp8_cast import cache_value
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue


@triton.jit
def _normed_rotated(
    row_ptr, stride_h, w_ptr, cos_row, sin_row, heads, head_ok, eps, half,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_CENTERED: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """The heads ``heads`` of one token normalised and rotated: ([HEADS, BLOCK_D] float32, mask).

    Each lane also loads its rotation partner (rotate-half or the pair neighbour), normalised with
    the same per-head statistics, so the rotation needs no cross-lane shuffle.
    """
    d = tl.arange(0, BLOCK_D)
    in_rot = d < 2 * half
    if INTERLEAVED:
        first = d % 2 == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    else:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        freq = tl.where(first, d, d - half)
    partner = tl.where(in_rot, partner, d)
    d_ok = d < HEAD_DIM
    mask = head_ok[:, None] & d_ok[None, :]
    ptrs = row_ptr + heads[:, None] * stride_h
    x = tl.load(ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)  # [HEADS, BLOCK_D]
    xp = tl.load(ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # [HEADS]
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
        wp = wp + 1.0
    in_dtype = row_ptr.dtype.element_ty
    # the unfused path stores the normed heads in the model dtype before rotating them
    y = (x * rstd[:, None] * w[None, :]).to(in_dtype).to(tl.float32)
    yp = (xp * rstd[:, None] * wp[None, :]).to(in_dtype).to(tl.float32)
    c = tl.load(cos_row + freq, mask=in_rot, other=1.0).to(tl.float32)  # [BLOCK_D]
    s = tl.load(sin_row + freq, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)  # first of a pair: a·c − b·s; second: b·c + a·s
    out = tl.where(in_rot[None, :], y * c[None, :] + yp * s[None, :], y)
    return out.to(in_dtype), mask


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_ct,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    eps, half,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEADS: tl.constexpr, PAGE: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
):
    """Grid (T, q head groups + kv head groups), ``HEADS`` heads a program.

    A q group writes its heads to ``q_out``; a kv group writes k (normed, rotated) and v (as is)
    to slot ``slot_mapping[t]`` of the caches, nothing when the slot is negative (padding).
    """
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(NUM_Q_HEADS, HEADS)
    cos_row = cos_ptr + t * stride_ct
    sin_row = sin_ptr + t * stride_ct
    d = tl.arange(0, BLOCK_D)
    if group < q_groups:
        heads = group * HEADS + tl.arange(0, HEADS)
        q, mask = _normed_rotated(q_ptr + t * stride_qt, stride_qh, q_w_ptr, cos_row, sin_row, heads,
                                  heads < NUM_Q_HEADS, eps, half, HEAD_DIM, BLOCK_D, ZERO_CENTERED, INTERLEAVED)
        dst = q_out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, q.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // PAGE
            off = slot % PAGE
            heads = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            head_ok = heads < NUM_KV_HEADS
            k, mask = _normed_rotated(k_ptr + t * stride_kt, stride_kh, k_w_ptr, cos_row, sin_row, heads, head_ok,
                                      eps, half, HEAD_DIM, BLOCK_D, ZERO_CENTERED, INTERLEAVED)
            k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + d[None, :]
            tl.store(k_dst, cache_value(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, SCALED), mask=mask)
            dv = tl.arange(0, BLOCK_DV)
            v_mask = head_ok[:, None] & (dv < HEAD_DIM_V)[None, :]
            v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=v_mask)
            v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + dv[None, :]
            tl.store(v_dst, cache_value(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, SCALED), mask=v_mask)


def _heads_per_program(num_tokens: int, num_heads: int, block_d: int) -> int:
    """One head a program for small steps (decode: most programs, lowest latency); a few heads for
    long prefills, so programs move ~1024 elements and fewer tiny ones are scheduled."""
    if num_tokens <= 64:
        return 1
    return max(1, min(next_power_of_2(num_heads), 1024 // block_d))


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    zero_centered: bool = True,
    interleaved: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm each q and k head, rotate the first ``2 * cos.shape[-1]`` dims, store k and v in the cache.

    q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (any token / head strides, unit last stride:
    views of the qkv projection); q_weight, k_weight: [D]; cos, sin: [T, rotary_dim // 2] float32
    (neox rotate-half, or ``interleaved`` pairs); k_cache: [num_blocks, block_size, Hkv, D],
    v_cache likewise with Dv; slot_mapping: [T] int on the device (negative: no store).
    k_scale, v_scale: fp32 scalars of an fp8 cache (k and v stored as ``x / scale`` in e4m3).
    Returns q normed and rotated: a new contiguous [T, Hq, D] in q's dtype.
    """
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    if k.shape != (T, Hkv, D) or v.shape[:2] != (T, Hkv) or k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k_cache.shape[2:] != (Hkv, D) or v_cache.shape[2:] != (Hkv, Dv) or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"qk_norm_rope_store: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
                         f"match k {tuple(k.shape)}, v {tuple(v.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache, cos, sin)):
        raise ValueError("qk_norm_rope_store: q, k, v, the caches, cos and sin need a unit last stride")
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.shape[0] != T or 2 * half > D:
        raise ValueError(f"qk_norm_rope_store: cos {tuple(cos.shape)}, sin {tuple(sin.shape)} must be "
                         f"[T, rotary_dim // 2] alike with rotary_dim <= head_dim {D}")
    if q_weight.shape != (D,) or k_weight.shape != (D,) or not (q_weight.is_contiguous() and k_weight.is_contiguous()):
        raise ValueError("qk_norm_rope_store: q_weight and k_weight must be contiguous [head_dim]")
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    block_d, block_dv = next_power_of_2(D), next_power_of_2(Dv)
    heads = _heads_per_program(T, Hq, max(block_d, block_dv))
    groups = cdiv(Hq, heads) + cdiv(Hkv, heads)
    _qk_norm_rope_store_kernel[(T, groups)](
        q, k, v, out, k_cache, v_cache, slot_mapping, q_weight, k_weight, cos, sin,
        k_scale if k_scale is not None else cos, v_scale if v_scale is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(eps), half,
        NUM_Q_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HEADS=heads, PAGE=k_cache.shape[1], ZERO_CENTERED=zero_centered, INTERLEAVED=interleaved,
        SCALED=k_scale is not None,
        num_warps=max(1, min(4, heads * max(block_d, block_dv) // 256)), **launch_options(q.device),
    )  # fmt: skip
    return out
