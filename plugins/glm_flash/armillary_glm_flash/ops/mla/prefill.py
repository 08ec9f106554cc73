"""MLA prefill, decompressed: keys and values expanded from the latents through ``kv_b_proj``, then plain
causal multi-head attention (fused SDPA on the GPU: cuDNN / flash for fresh prompts, a masked
kernel over cached context; the float32 reference attention elsewhere)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from armillary.kernels.attention import attend_fused, visible

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


def expanded_keys(kv: torch.Tensor, k_pe: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [L, H, nope + v] (``kv_b_proj`` of the latents), k_pe [L, Dr] -> keys [L, H, nope + Dr], values [L, H, v]."""
    length, heads = kv.shape[:2]
    k = torch.empty(length, heads, nope + k_pe.shape[-1], dtype=kv.dtype, device=kv.device)
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
