"""Fused store of new keys and values into the paged KV cache (one launch for K and V)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.fp8_cast import cache_value
from armillary.kernels.triton.host import next_power_of_2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Grid (T,): token t's [Hkv, D] keys and [Hkv, Dv] values go to slot ``slot_mapping[t]`` (< 0: skipped)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = heads[:, None] < NUM_KV_HEADS
    k_mask = h_ok & (offs_d[None, :] < HEAD_DIM)
    v_mask = h_ok & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=k_mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_dv[None, :], mask=v_mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + offs_dv[None, :]
    tl.store(k_dst, cache_value(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, SCALED), mask=k_mask)
    tl.store(v_dst, cache_value(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, SCALED), mask=v_mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store new K/V by flat slot, cast to the cache dtype; negative slots (padding tokens) are skipped.

    k: [T, Hkv, D], v: [T, Hkv, Dv] (any token/head strides, head dim contiguous, e.g. views of a
    fused qkv projection); k_cache: [num_blocks, block_size, Hkv, D], v_cache likewise with Dv;
    slot_mapping: [T] int32/int64 on the device, slot = block * block_size + offset.
    k_scale, v_scale: fp32 scalars of an fp8 cache (stores ``x / scale`` in e4m3), None otherwise.
    """
    T, Hkv, D = k.shape
    Dv = v.shape[2]
    if v.shape[:2] != (T, Hkv) or k_cache.shape[2:] != (Hkv, D) or v_cache.shape[2:] != (Hkv, Dv):
        raise ValueError(f"write_kv_cache: k {tuple(k.shape)}, v {tuple(v.shape)} do not match caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: the head dim of k, v and the caches must be contiguous")
    if T == 0:
        return
    block_d = next_power_of_2(D)
    block_dv = next_power_of_2(Dv)
    block_h = next_power_of_2(Hkv)
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if k_scale is not None else k,
        v_scale if v_scale is not None else v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
        PAGE=k_cache.shape[1], SCALED=k_scale is not None, num_warps=4 if block_h * max(block_d, block_dv) >= 1024 else 1,
    )
