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


def sigmoid_topk(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 scaling: float = 1.0, n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias, group-limited (DeepSeek-V3 / Nemotron-H / GLM).

    scores = sigmoid(logits [T, E]); choice = scores + bias [E]. With ``n_group`` > 1 the experts
    form ``n_group`` equal groups, each group scores the sum of its two best choices, and only the
    experts of the ``topk_group`` best groups stay eligible. The ``top_k`` best eligible choices are
    kept with their unbiased scores, renormalised (sum + 1e-20) if asked, times ``scaling``.
    Returns (weights [T, k] float32, ids [T, k] int64).
    """
    scores = router_logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        num_tokens, num_experts = choice.shape
        if num_experts % n_group:
            raise ValueError(f"sigmoid_topk: {num_experts} experts do not split into {n_group} groups")
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, n_group]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, n_group]
        choice = choice.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


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
