"""One Triton launch per MLA layer and step for what comes between the projections and the attention: the
latent's RMSNorm (``kv_a_layernorm``), rotary on the shared rope key and, in place, on every head's query
rope dims, and the store of ``[normed latent | rotated key]`` into the paged latent cache.

Same math as ``naive.rope_store_ref`` (float32 statistics and rotation, each result rounded to its
tensor's dtype): it replaces a norm, two rotary launches with their copies, a concatenation and an
index copy (seven launches per layer on a decode step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from armillary.kernels.triton.host import next_power_of_2


@triton.jit
def rope_store_token(
    t, q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Token ``t``'s share: q [T, H, NOPE + DR] rotated in place on its last DR dims; ckv [T, DL + DR] read
    (also called by ``absorb``'s fused launch)."""
    half = DR // 2
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < half
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + half
    cos = tl.load(cos_ptr + t * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    row = kv_ptr + slot * stride_kv
    # the latent: RMSNorm in float32, x̂ · w rounded to the model dtype, then to the cache's
    d = tl.arange(0, BLOCK_DL)
    d_ok = d < DL
    x = tl.load(ckv_ptr + t * stride_ct + d, mask=d_ok, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / DL + eps)
    w = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    normed = (xf * rstd * w).to(x.dtype)
    tl.store(row + d, normed.to(kv_ptr.dtype.element_ty), mask=d_ok)
    # the shared rope key
    k1 = tl.load(ckv_ptr + t * stride_ct + DL + first, mask=j_ok, other=0.0)
    k2 = tl.load(ckv_ptr + t * stride_ct + DL + second, mask=j_ok, other=0.0)
    a, b = k1.to(tl.float32), k2.to(tl.float32)
    tl.store(row + DL + first, (a * cos - b * sin).to(k1.dtype).to(kv_ptr.dtype.element_ty), mask=j_ok)
    tl.store(row + DL + second, (b * cos + a * sin).to(k1.dtype).to(kv_ptr.dtype.element_ty), mask=j_ok)
    # every head's query rope dims, in place
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & j_ok[None, :]
    base = q_ptr + t * stride_qt + h[:, None] * stride_qh + NOPE
    q1 = tl.load(base + first[None, :], mask=mask, other=0.0)
    q2 = tl.load(base + second[None, :], mask=mask, other=0.0)
    a, b = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(base + first[None, :], (a * cos[None, :] - b * sin[None, :]).to(q1.dtype), mask=mask)
    tl.store(base + second[None, :], (b * cos[None, :] + a * sin[None, :]).to(q1.dtype), mask=mask)


@triton.jit
def _mla_rope_store_kernel(
    q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Grid (T,): one token each."""
    rope_store_token(tl.program_id(0), q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
                     stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
                     NOPE, DL, DR, BLOCK_DL, BLOCK_HALF, BLOCK_H, INTERLEAVED)


def check_rope_store(q: torch.Tensor, ckv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, kv: torch.Tensor) -> tuple[int, int]:
    """(latent width, rope width) after the layout checks every rope-store launch needs."""
    width = q.shape[2]
    dr = 2 * cos.shape[-1]
    dl = ckv.shape[1] - dr
    if kv.shape[2] != dl + dr or weight.shape[0] != dl or width < dr:
        raise ValueError(f"mla_rope_store: ckv {tuple(ckv.shape)}, q {tuple(q.shape)} and the cache "
                         f"{tuple(kv.shape)} disagree on latent {dl} + rope {dr}")
    if q.stride(2) != 1 or ckv.stride(1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("mla_rope_store: q, ckv, cos and sin need unit last strides (cos and sin alike)")
    if kv.stride(2) != 1 or kv.stride(0) != kv.shape[1] * kv.stride(1):
        raise ValueError("mla_rope_store: the cache's blocks must be contiguous rows (flat slot addressing)")
    return dl, dr


def rope_store_meta(q: torch.Tensor, dl: int, dr: int) -> dict:
    """The rope-store constexprs of a launch."""
    return dict(NOPE=q.shape[2] - dr, DL=dl, DR=dr, BLOCK_DL=next_power_of_2(dl),
                BLOCK_HALF=max(1, next_power_of_2(dr // 2)), BLOCK_H=next_power_of_2(q.shape[1]))


def mla_rope_store(q: torch.Tensor, ckv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, interleaved: bool) -> None:
    """q [T, H, nope + Dr] (rotated in place), ckv [T, Dl + Dr] (``kv_a_proj_with_mqa``'s output), weight [Dl],
    cos / sin [T, Dr / 2] float32, kv [NB, BS, Dl + Dr], slot_mapping [T]. Unit last strides throughout."""
    dl, dr = check_rope_store(q, ckv, weight, cos, sin, kv)
    if q.shape[0] == 0:
        return
    _mla_rope_store_kernel[(q.shape[0],)](
        q, ckv, weight, cos, sin, slot_mapping, kv, q.stride(0), q.stride(1), ckv.stride(0), cos.stride(0),
        kv.stride(1), q.shape[1], float(eps), INTERLEAVED=interleaved, num_warps=4, **rope_store_meta(q, dl, dr),
    )
