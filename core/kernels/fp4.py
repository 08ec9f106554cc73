"""NVFP4 weights (e2m1 values, fp8 group scales, fp32 global scale), plain torch: unpack, dequantize, quantizer, reference GEMM / MoE.

Layout of a weight W [N, K] (K a multiple of 16), as ModelOpt and compressed-tensors store it:

- ``packed`` uint8 [N, K / 2]: two e2m1 codes per byte, column ``2j`` in the **low** nibble
  (``byte & 0xF``) and column ``2j + 1`` in the high nibble (``byte >> 4``). A code is
  ``s m m m``: bit 3 the sign, bits 0-2 index ``E2M1_VALUES`` = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- ``scale`` float8_e4m3fn [N, K / 16]: one scale per row and group of 16 columns
  (group ``g`` covers columns ``16g .. 16g + 15``), multiplied in.
- ``global_scale`` fp32: per tensor in checkpoints (ModelOpt ``weight_scale_2``, multiplied in;
  compressed-tensors stores its reciprocal), one per output row [N] in the kernel interfaces
  (``row_global_scale``), so stacked shards (q / k / v, gate / up) keep their own exactly.

``W[n, k] = E2M1[code[n, k]] · float(scale[n, k // 16]) · global_scale[n]``. The references
dequantize into the activation dtype (weight-only, W4A16: the CPU path and the kernels' oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from armillary.kernels.activation import get_activation

FP4_GROUP = 16  # columns per fp8 group scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# round-to-nearest boundaries between consecutive magnitudes; a tie goes to the even code
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ODD_BOUNDS = (0.75, 1.75, 3.5)  # ties at these round up (to codes 2, 4, 6)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [16]: the value of each 4-bit code (8..15 negative; code 8 is -0.0)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> uint8 codes [..., K] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed e2m1 weights are uint8, not {packed.dtype}")
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)  # [..., K/2, 2] -> [..., K]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K / 2], column 2j in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))  # [..., K/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> fp32 [..., K] e2m1 values (no scales)."""
    return e2m1_table(packed.device)[unpack_codes(packed).long()]


def row_global_scale(global_scale: torch.Tensor | float, rows: int) -> torch.Tensor:
    """A per-tensor global scale ([], or [E] for stacked experts) -> fp32 [rows] (or [E, rows])."""
    g = torch.as_tensor(global_scale, dtype=torch.float32)
    if g.dim() == 0:
        return g.reshape(1).expand(rows).contiguous()
    return g.reshape(-1, 1).expand(-1, rows).contiguous()  # [E] -> [E, rows]


def check_shapes(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 what: str = "fp4 weight") -> int:
    """K of an NVFP4 weight after checking its three tensors agree; a ``ValueError`` naming ``what`` otherwise."""
    *lead, n, half = packed.shape
    k = 2 * half
    want_scale = (*lead, n, k // FP4_GROUP)
    if packed.dtype != torch.uint8 or k % FP4_GROUP:
        raise ValueError(f"{what}: packed weight must be uint8 [..., N, K/2] with K a multiple of {FP4_GROUP}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if tuple(scale.shape) != want_scale or scale.dtype != FP8_DTYPE:
        raise ValueError(f"{what}: group scales must be float8_e4m3fn {want_scale}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if tuple(global_scale.shape) != (*lead, n):
        raise ValueError(f"{what}: global scale must be fp32 {(*lead, n)} (one per output row), got "
                         f"{tuple(global_scale.shape)}")
    return k


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 [..., N, K / 2] with group scales [..., N, K / 16] and row global scales [..., N] ->
    [..., N, K] in ``dtype`` (the product in fp32, then rounded once)."""
    values = decode_e2m1(packed).unflatten(-1, (-1, FP4_GROUP))  # [..., N, K/16, 16]
    row_scale = scale.float() * global_scale.float()[..., None]  # [..., N, K/16]
    return (values * row_scale[..., None]).flatten(-2).to(dtype)


def _round_to_codes(a: torch.Tensor) -> torch.Tensor:
    """|values| already divided by their scales (clamped to [0, 6]) -> magnitude codes 0..7, ties to even."""
    bounds = torch.tensor(_BOUNDS, dtype=a.dtype, device=a.device)
    codes = torch.bucketize(a, bounds)  # boundaries strictly below a
    ties_up = torch.isin(a, torch.tensor(_ODD_BOUNDS, dtype=a.dtype, device=a.device))
    return (codes + ties_up.long()).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] float (K a multiple of 16) -> (packed uint8 [..., N, K/2], scales e4m3 [..., N, K/16],
    global fp32 [...]) as ModelOpt exports it: global = amax(|w|) / (6 · 448) per matrix (the value
    *multiplied in*, ``weight_scale_2``), each group's scale = its amax / 6 / global rounded to e4m3,
    each value rounded to the nearest e2m1 (ties to even) after dividing by scale · global.
    ``global_scale`` (same leading shape, or a number) overrides the per-matrix choice."""
    if w.shape[-1] % FP4_GROUP:
        raise ValueError(f"NVFP4 needs K a multiple of {FP4_GROUP}, got shape {tuple(w.shape)}")
    wf = w.float()
    if global_scale is None:
        amax = wf.abs().amax(dim=(-2, -1))  # [...]
        g = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax))
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).expand(wf.shape[:-2]).clone()
    groups = wf.unflatten(-1, (-1, FP4_GROUP))  # [..., N, K/16, 16]
    gb = g[..., None, None]  # [..., 1, 1]
    scale = (groups.abs().amax(dim=-1) / E2M1_MAX / gb).clamp(max=FP8_MAX).to(FP8_DTYPE)  # [..., N, K/16]
    denom = scale.float() * gb  # [..., N, K/16]
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom[..., None] > 0, groups / safe[..., None], torch.zeros_like(groups))
    mags = _round_to_codes(scaled.abs().clamp(max=E2M1_MAX))
    codes = mags | (torch.signbit(scaled) & (mags > 0)).to(torch.uint8) << 3  # no -0 codes
    return pack_codes(codes.flatten(-2)), scale, g


def linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequant(W).T + bias``: x [M, K], W NVFP4 [N, K] -> [M, N] in x's dtype (the CPU path)."""
    return F.linear(x, dequantize(w_packed, w_scale, global_scale, x.dtype), bias)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, w2: torch.Tensor,
              s2: torch.Tensor, g2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """Routed NVFP4 experts: x [T, H]; w13 uint8 [E, 2I or I, H/2], s13 e4m3 [E, 2I or I, H/16], g13 fp32
    [E, 2I or I]; w2 uint8 [E, H, I/2], s2 [E, H, I/16], g2 [E, H]; topk_* [T, k]. Only the experts in
    use are dequantized (into x's dtype). Returns [T, H] in x's dtype."""
    inter = 2 * w2.shape[2]
    gated = w13.shape[1] == 2 * inter
    act = get_activation(activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of[picks]
        h = linear(x[tokens], w13[expert], s13[expert], g13[expert], None)  # [n, 2I] or [n, I]
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        y = linear(h, w2[expert], s2[expert], g2[expert], None)  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[picks, None].float())
    return out.to(x.dtype)
