"""Gemma 4's q / k / v head norms, rotary and paged K/V store in one Triton launch.

Core's ``qk_norm_rope_store`` stores v as it comes; Gemma 4 also normalises each value head (an
unscaled RMSNorm), so unfused that is a separate norm launch before it. Global layers with
``attention_k_eq_v`` pass the raw key projection as v: each kv program reads it before normalising
k, so no copy is needed. Rotary is neox rotate-half on the first ``2 * cos.shape[-1]`` dims
(proportional RoPE: zero frequencies past the rotated part). Rounding follows the unfused path
(norm rounded to the model dtype, rotated in float32, rounded again; values normed and rounded,
then cast to the cache dtype). The reference is ``naive.gemma4_qkv_norm_rope_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import ops
from armillary.kernels.triton.fp8_cast import cache_value
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue


@triton.jit
def _head_rows(row_ptr, stride_h, heads, head_ok, d, partner, d_ok):
    """[HEADS, BLOCK_D] float32 values and their rotation partners of one token's heads."""
    ptrs = row_ptr + heads[:, None] * stride_h
    mask = head_ok[:, None] & d_ok[None, :]
    x = tl.load(ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, xp, mask


@triton.jit
def _norm_rotate(x, xp, w_ptr, d, partner, d_ok, first, in_rot, c, s, eps, dt, HEAD_DIM: tl.constexpr):
    """Each head of x normed (weight w), rounded to ``dt``, rotated in float32 against its partner lanes."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # [HEADS]
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    y = (x * rstd[:, None] * w[None, :]).to(dt).to(tl.float32)
    yp = (xp * rstd[:, None] * wp[None, :]).to(dt).to(tl.float32)
    return tl.where(in_rot[None, :], y * c[None, :] + yp * s[None, :], y).to(dt)


@triton.jit
def _qkv_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
    k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_ct, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, eps, half,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr, PAGE: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, q head groups + kv head groups): a q group writes q_out; a kv group writes k (normed, rotated)
    and v (normed) to slot ``slot_mapping[t]`` of the caches, nothing for a negative slot (padding)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(NUM_Q_HEADS, HEADS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    in_rot = d < 2 * half
    first = d < half
    partner = tl.where(in_rot, tl.where(first, d + half, d - half), d)
    freq = tl.where(first, d, d - half)
    c = tl.load(cos_ptr + t * stride_ct + freq, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + freq, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)  # first of a pair: a·c − b·s; second: b·c + a·s
    dt = q_out_ptr.dtype.element_ty
    if group < q_groups:
        heads = group * HEADS + tl.arange(0, HEADS)
        x, xp, mask = _head_rows(q_ptr + t * stride_qt, stride_qh, heads, heads < NUM_Q_HEADS, d, partner, d_ok)
        q = _norm_rotate(x, xp, q_w_ptr, d, partner, d_ok, first, in_rot, c, s, eps, dt, HEAD_DIM)
        tl.store(q_out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], q, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // PAGE
            off = slot % PAGE
            heads = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            head_ok = heads < NUM_KV_HEADS
            # v first: with k = v it is the raw key projection, read before anything is written
            v, _, mask = _head_rows(v_ptr + t * stride_vt, stride_vh, heads, head_ok, d, d, d_ok)
            v = (v * tl.rsqrt(tl.sum(v * v, axis=1) / HEAD_DIM + eps)[:, None]).to(dt)
            x, xp, _ = _head_rows(k_ptr + t * stride_kt, stride_kh, heads, head_ok, d, partner, d_ok)
            k = _norm_rotate(x, xp, k_w_ptr, d, partner, d_ok, first, in_rot, c, s, eps, dt, HEAD_DIM)
            k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + d[None, :]
            tl.store(k_dst, cache_value(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, SCALED), mask=mask)
            v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + d[None, :]
            tl.store(v_dst, cache_value(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, SCALED), mask=mask)


def qkv_norm_rope_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (strided head views, unit last stride; v may be k itself); caches
    [blocks, page, Hkv, D]; cos, sin: [T, rot / 2] -> q normed and rotated, a new contiguous [T, Hq, D]."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (T, Hkv, D) or v.shape != (T, Hkv, D) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"qkv_norm_rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k_cache.shape[2:] != (Hkv, D) or v_cache.shape[2:] != (Hkv, D) or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"qkv_norm_rope_store: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
                         f"match k {tuple(k.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache, cos, sin)):
        raise ValueError("qkv_norm_rope_store: q, k, v, the caches, cos and sin need a unit last stride")
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.shape[0] != T or 2 * half > D:
        raise ValueError(f"qkv_norm_rope_store: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be "
                         f"[T, rotary_dim // 2] alike with rotary_dim <= head_dim {D}")
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    block_d = next_power_of_2(D)
    heads = 1 if T <= 64 else max(1, min(next_power_of_2(Hq), 1024 // block_d))  # decode: most programs
    groups = cdiv(Hq, heads) + cdiv(Hkv, heads)
    _qkv_norm_rope_store_kernel[(T, groups)](
        q, k, v, out, k_cache, v_cache, slot_mapping, q_weight.contiguous(), k_weight.contiguous(), cos, sin,
        k_scale if k_scale is not None else cos, v_scale if v_scale is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(eps), half,
        NUM_Q_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_D=block_d, HEADS=heads, PAGE=k_cache.shape[1],
        SCALED=k_scale is not None, num_warps=max(1, min(4, heads * block_d // 256)), **launch_options(q.device),
    )  # fmt: skip
    return out


def qkv_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, v_unit: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
    """One launch where Triton serves ``q``; elsewhere core's v norm (weight ``v_unit``, ones) and its fused
    q/k norm + rope + store (the reference ops on the CPU)."""
    if ops.use_triton(q):
        return qkv_norm_rope_store_triton(q, k, v, q_weight, k_weight, eps, cos, sin, cache.k, cache.v,
                                          batch.slot_mapping_of(cache), cache.k_scale, cache.v_scale)
    v = ops.rms_norm(v, v_unit, eps)  # strided head view read in place
    return ops.qk_norm_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, cache, batch, zero_centered=False)
