"""One Triton launch per MLA layer and step for what comes between the projections and the attention: the
latent's RMSNorm (``kv_a_layernorm``), rotary on the shared rope key and, in place, on every head's query
rope dims, and the store of ``[normed latent | rotated key]`` into the paged latent cache.

Same math as ``naive.rope_store_ref`` (float32 statistics and rotation, each result rounded to its
tensor's dtype): it replaces a norm, two rotary launches with their copies, a concatenation and an
index copy (seven launches per layer on a decode step). ``mla_rope_store`` (prefill chunks) takes
``BLOCK_T`` tokens a program (``rope_store_rows``); ``rope_store_token``, the same on one token, is what the
absorbed decode's fused launch calls.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from armillary.kernels.triton.host import cdiv, next_power_of_2

BLOCK_T = 4  # tokens a prefill program (H200, 16K tokens of GLM-4.7-Flash: 101 us at 4, 104 at 1, 136 at 8)


@triton.jit
def rotate_rows(src, dst, cos, sin, row_ok, DR: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Rotary on ROWS rows of DR dims: src / dst [ROWS] pointers to each row's first rope dim (the same for an
    in-place update), cos / sin [ROWS, BLOCK_HALF] fp32; float32 math, rounded to the source's dtype, then the
    destination's. Interleaved pairs (2j, 2j + 1) are loaded and stored as whole rows and split in registers:
    stride-2 stores of 2-byte values cost GLM-4.7-Flash's 16K-token prefill 330 us a layer."""
    j_ok = (tl.arange(0, BLOCK_HALF) < DR // 2)[None, :]
    if INTERLEAVED:
        r = tl.arange(0, 2 * BLOCK_HALF)
        ok = row_ok[:, None] & (r < DR)[None, :]
        x = tl.load(src[:, None] + r[None, :], mask=ok, other=0.0)  # [ROWS, 2 BLOCK_HALF]
        x1, x2 = tl.split(tl.reshape(x, [ROWS, BLOCK_HALF, 2]))
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1, o2 = (a * cos - b * sin).to(x.dtype), (b * cos + a * sin).to(x.dtype)
        out = tl.reshape(tl.join(o1, o2), [ROWS, 2 * BLOCK_HALF])
        tl.store(dst[:, None] + r[None, :], out.to(dst.dtype.element_ty), mask=ok)
    else:
        j = tl.arange(0, BLOCK_HALF)[None, :]
        ok = row_ok[:, None] & j_ok
        x1 = tl.load(src[:, None] + j, mask=ok, other=0.0)
        x2 = tl.load(src[:, None] + j + DR // 2, mask=ok, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst[:, None] + j, (a * cos - b * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)
        tl.store(dst[:, None] + j + DR // 2, (b * cos + a * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def rope_store_rows(
    t0, t_end, q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Tokens t0 .. t0 + BLOCK_T - 1 (those below ``t_end``): q [T, H, NOPE + DR] rotated in place on its last DR
    dims, ckv [T, DL + DR] read: the normed latent and the rotated shared rope key stored in the cache."""
    t = t0 + tl.arange(0, BLOCK_T)
    t_ok = t < t_end
    tt = t.to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cs_ok = t_ok[:, None] & (j < DR // 2)[None, :]
    cos = tl.load(cos_ptr + tt[:, None] * stride_cs + j[None, :], mask=cs_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tt[:, None] * stride_cs + j[None, :], mask=cs_ok, other=0.0).to(tl.float32)
    row = kv_ptr + tl.load(slots_ptr + t, mask=t_ok, other=0).to(tl.int64) * stride_kv  # [BT]
    # the latents: RMSNorm in float32, x̂ · w rounded to the model dtype, then to the cache's
    d = tl.arange(0, BLOCK_DL)
    x_ok = t_ok[:, None] & (d < DL)[None, :]
    x = tl.load(ckv_ptr + tt[:, None] * stride_ct + d[None, :], mask=x_ok, other=0.0)  # [BT, BDL]
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / DL + eps)  # [BT]
    w = tl.load(weight_ptr + d, mask=d < DL, other=0.0).to(tl.float32)
    normed = (xf * rstd[:, None] * w[None, :]).to(x.dtype)
    tl.store(row[:, None] + d[None, :], normed.to(kv_ptr.dtype.element_ty), mask=x_ok)
    # the shared rope keys
    rotate_rows(ckv_ptr + tt * stride_ct + DL, row + DL, cos, sin, t_ok, DR, BLOCK_HALF, BLOCK_T, INTERLEAVED)
    # every head's query rope dims, in place: rows (token, head)
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    ti, h = r // BLOCK_H, r % BLOCK_H
    q_rows = q_ptr + (t0 + ti).to(tl.int64) * stride_qt + h * stride_qh + NOPE
    q_ok = tl.reshape(t_ok[:, None] & (tl.arange(0, BLOCK_H) < num_heads)[None, :], [BLOCK_T * BLOCK_H])
    rotate_rows(q_rows, q_rows, tl.reshape(tl.broadcast_to(cos[:, None, :], [BLOCK_T, BLOCK_H, BLOCK_HALF]),
                                           [BLOCK_T * BLOCK_H, BLOCK_HALF]),
                tl.reshape(tl.broadcast_to(sin[:, None, :], [BLOCK_T, BLOCK_H, BLOCK_HALF]),
                           [BLOCK_T * BLOCK_H, BLOCK_HALF]),
                q_ok, DR, BLOCK_HALF, BLOCK_T * BLOCK_H, INTERLEAVED)


@triton.jit
def rope_store_token(
    t, q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Token ``t``'s share (``absorb``'s fused decode launch): ``rope_store_rows`` on one token."""
    rope_store_rows(t, t + 1, q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
                    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
                    NOPE, DL, DR, BLOCK_DL, BLOCK_HALF, BLOCK_H, INTERLEAVED, 1)


@triton.jit
def _mla_rope_store_kernel(
    q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr, T,
    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T),): BLOCK_T tokens a program."""
    rope_store_rows(tl.program_id(0) * BLOCK_T, T, q_ptr, ckv_ptr, weight_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
                    stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
                    NOPE, DL, DR, BLOCK_DL, BLOCK_HALF, BLOCK_H, INTERLEAVED, BLOCK_T)


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
                   sin: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, interleaved: bool,
                   block_t: int = BLOCK_T, num_warps: int = 4) -> None:
    """q [T, H, nope + Dr] (rotated in place), ckv [T, Dl + Dr] (``kv_a_proj_with_mqa``'s output), weight [Dl],
    cos / sin [T, Dr / 2] float32, kv [NB, BS, Dl + Dr], slot_mapping [T]. Unit last strides throughout.
    ``block_t``: tokens a program (a power of two)."""
    dl, dr = check_rope_store(q, ckv, weight, cos, sin, kv)
    tokens = q.shape[0]
    if tokens == 0:
        return
    _mla_rope_store_kernel[(cdiv(tokens, block_t),)](
        q, ckv, weight, cos, sin, slot_mapping, kv, tokens, q.stride(0), q.stride(1), ckv.stride(0), cos.stride(0),
        kv.stride(1), q.shape[1], float(eps), INTERLEAVED=interleaved, BLOCK_T=block_t, num_warps=num_warps,
        **rope_store_meta(q, dl, dr),
    )
