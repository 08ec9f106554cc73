"""MLA prefill, decompressed: keys and values expanded from the latents through ``kv_b_proj``, then plain
causal multi-head attention (fused SDPA on the GPU: cuDNN / flash for fresh prompts, a masked
kernel over cached context; the float32 reference attention elsewhere). The keys ``[nope | shared rope
key]`` are written in one Triton pass on a GPU (torch's two copies took 210 us a layer at 16K tokens);
the values stay a strided view of ``kv_b_proj``'s output (cuDNN reads it as it is)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from armillary.kernels.attention import attend_fused, visible
from armillary.kernels.triton.host import cdiv, next_power_of_2

FRESH_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
FALLBACK_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_refused: set[tuple] = set()  # (backends, shapes) that raised once: not tried again


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: list, scale: float,
          mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA under ``backends``; a backend that takes the call but fails on these shapes is not asked again."""
    key = (tuple(backends), q.dtype, q.shape[1], q.shape[3], v.shape[3], mask is None)
    if key not in _refused:
        try:
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        except RuntimeError:
            _refused.add(key)
    with sdpa_kernel(FALLBACK_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


@triton.jit
def _expand_keys_kernel(kv_ptr, pe_ptr, k_ptr, L, stride_kvt, stride_kvh, stride_pe, NOPE: tl.constexpr,
                        DR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid (cdiv(L, BLOCK_T), H): k[t, h] = [kv[t, h, :NOPE] | pe[t]] for BLOCK_T rows of one head."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t_ok = (t < L)[:, None]
    tt = t.to(tl.int64)[:, None]
    nope = tl.load(kv_ptr + tt * stride_kvt + h * stride_kvh + d[None, :], mask=t_ok & (d < NOPE)[None, :],
                   other=0.0)
    pe = tl.load(pe_ptr + tt * stride_pe + (d - NOPE)[None, :], mask=t_ok & ((d >= NOPE) & (d < NOPE + DR))[None, :],
                 other=0.0)
    row = k_ptr + (tt * tl.num_programs(1) + h) * (NOPE + DR)
    tl.store(row + d[None, :], tl.where((d < NOPE)[None, :], nope, pe), mask=t_ok & (d < NOPE + DR)[None, :])


def expanded_keys(kv: torch.Tensor, k_pe: torch.Tensor, nope: int,
                  triton_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [L, H, nope + v] (``kv_b_proj`` of the latents), k_pe [L, Dr] -> keys [L, H, nope + Dr] (contiguous),
    values [L, H, v] (a view of kv). ``triton_kernel``: the one-pass kernel (None: on a GPU), else two copies."""
    length, heads = kv.shape[:2]
    dr = k_pe.shape[-1]
    k = torch.empty(length, heads, nope + dr, dtype=kv.dtype, device=kv.device)
    use = kv.is_cuda if triton_kernel is None else triton_kernel
    if use and length and kv.stride(2) == 1 and k_pe.stride(1) == 1:
        block_t = 16
        _expand_keys_kernel[(cdiv(length, block_t), heads)](
            kv, k_pe, k, length, kv.stride(0), kv.stride(1), k_pe.stride(0), NOPE=nope, DR=dr,
            BLOCK_D=next_power_of_2(nope + dr), BLOCK_T=block_t, num_warps=4)
    else:
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = k_pe[:, None, :]  # the one rope key, broadcast to every head
    return k, kv[..., nope:]


def decompressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                           scale: float) -> torch.Tensor:
    """One sequence: q [n, H, Dqk] at positions ``context_len ..``, k [L, H, Dqk], v [L, H, Dv] with
    L = context_len + n -> [n, H, Dv] in q's dtype."""
    n, length = q.shape[0], k.shape[0]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return attend_fused(q, k, v, scale)  # float32 math, causal with the offset
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, *, D]
    if context_len == 0 or n == 1:
        out = _sdpa(qh, kh, vh, FRESH_BACKENDS, scale, None, causal=n > 1)
    else:
        mask = visible(n, length, None, q.device)  # [n, L]: the chunk's queries after the cached context
        out = _sdpa(qh, kh, vh, MASKED_BACKENDS, scale, mask, causal=False)
    return out[0].transpose(0, 1)
