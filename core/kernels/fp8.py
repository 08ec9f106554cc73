"""FP8 (e4m3) weights and activations, plain torch: quantizers, dequantization, and the reference GEMM / MoE.

One scale layout serves every granularity: a weight [N, K] (or [E, N, K]) carries fp32 scales
[ceil(N / bn), ceil(K / bk)] for blocks of (bn, bk) elements, and dequantizes by *multiplying*
(``w = q · scale``, the ``weight_scale_inv`` of Qwen / DeepSeek checkpoints). Per-channel is the
block (1, K) (scales [N, 1]), per-tensor the block (N, K). The references dequantize the weight
into the activation dtype (the CPU path, W8A16); ``linear_w8a8`` / ``fused_moe_w8a8`` also
quantize the activations per token and group of ``bk`` columns as the Triton kernels do (their
oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from armillary.kernels.activation import get_activation

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
MIN_SCALE = 1e-12  # an all-zero block keeps a usable scale


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int) -> torch.Tensor:
    """[..., ceil(rows / bn), ceil(cols / bk)] -> [..., rows, cols] (each block's scale over its elements)."""
    r = torch.arange(rows, device=scale.device) // block_n
    c = torch.arange(cols, device=scale.device) // block_k  # a block_k >= cols (per-channel) picks column 0
    return scale.index_select(-2, r).index_select(-1, c)


def quantize_blocks(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (fp8 [..., N, K], fp32 scales [..., ceil(N/bn), ceil(K/bk)]), amax / 448 per block."""
    n, k = w.shape[-2:]
    block_n, block_k = min(block_n, n), min(block_k, k)  # a block past the edge is the whole dimension
    pn, pk = _cdiv(n, block_n) * block_n, _cdiv(k, block_k) * block_k
    padded = F.pad(w.float(), (0, pk - k, 0, pn - n))
    blocks = padded.unflatten(-1, (pk // block_k, block_k)).unflatten(-3, (pn // block_n, block_n))  # [.., nb, bn, kb, bk]
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., nb, kb]
    q = (w.float() / expand_scale(scale, n, k, block_n, block_k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [..., N, K] with block scales -> [..., N, K] in ``dtype`` (fp32 product, then rounded)."""
    n, k = q.shape[-2:]
    return (q.float() * expand_scale(scale.float(), n, k, block_n, block_k)).to(dtype)


def quantize_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group activation quantization: x [M, K] -> (fp8 [M, K], fp32 [M, ceil(K / group)])."""
    return quantize_blocks(x, 1, group)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
           bias: torch.Tensor | None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias``: x [M, K], weight fp8 [N, K] -> [M, N] in x's dtype (the CPU path);
    ``tail`` [N_t, K] in x's dtype: unquantized rows after the fp8 ones ([M, N + N_t])."""
    w = dequantize(weight, scale, block_n, block_k, x.dtype)
    return F.linear(x, w if tail is None else torch.cat([w, tail]), bias)


def linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                bias: torch.Tensor | None, group: int | None = None) -> torch.Tensor:
    """As ``linear`` with x quantized per token and ``group`` columns (default ``min(block_k, 128)``),
    float32 accumulation: what the Triton block-scaled GEMM computes."""
    g = group or min(block_k, 128)
    xq, xs = quantize_act_groups(x, g)
    xd = dequantize(xq, xs, 1, g)
    out = xd @ dequantize(weight, scale, block_n, block_k).T  # [M, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              block_n: int, block_k: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", quantize_input: bool = False) -> torch.Tensor:
    """Routed fp8 experts: x [T, H], w13 [E, 2I or I, H], w2 [E, H, I] fp8 with block scales s13 / s2;
    only the experts in use are dequantized. ``quantize_input`` emulates the kernels' activation
    quantization (per token, ``min(block_k, 128)`` columns) before each GEMM. Returns [T, H] in x's dtype."""
    inter = w2.shape[2]
    gated = w13.shape[1] == 2 * inter
    act = get_activation(activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1)
    mm = (lambda a, q, s: linear_w8a8(a, q, s, block_n, block_k, None)) if quantize_input else \
        (lambda a, q, s: linear(a, q, s, block_n, block_k, None))
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of[picks]
        h = mm(x[tokens], w13[expert], s13[expert])  # [n, 2I] or [n, I]
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        y = mm(h, w2[expert], s2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[picks, None].float())
    return out.to(x.dtype)
