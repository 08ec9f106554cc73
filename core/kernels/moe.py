"""Mixture of experts over stacked expert weights: routing and the expert computation (reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from armillary.kernels.activation import get_activation


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: probabilities over all experts, keep the ``top_k`` largest.

    router_logits: [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64). With
    ``renormalize`` the kept weights are rescaled to sum to 1 (``norm_topk_prob``).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight · expert(x)``.

    hidden: [T, H]; w2: [E, H, I]; w13: [E, 2I, H] rows [gate | up] for a gated expert
    (``act(gate) · up``, e.g. SwiGLU) or [E, I, H] for a plain one (``act(up)``, e.g. relu²);
    the shapes decide which. topk_weights: [T, k]; topk_ids: [T, k]. Expert outputs are weighted
    and summed in float32; returns [T, H] in hidden's dtype.
    """
    inter = w2.shape[2]
    if w13.shape[1] == 2 * inter:
        gated = True
    elif w13.shape[1] == inter:
        gated = False
    else:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} fits neither [E, 2I, H] nor [E, I, H] for w2 {tuple(w2.shape)}")
    act = get_activation(activation)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of[picks]
        x = hidden[tokens]
        h = F.linear(x, w13[expert])  # [n, 2I] or [n, I]
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        y = F.linear(h, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[picks, None].float())
    return out.to(hidden.dtype)
