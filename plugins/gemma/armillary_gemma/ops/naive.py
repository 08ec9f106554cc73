"""Float32 references of the plugin's Triton kernels (the oracle in tests)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up] -> gelu_tanh(gate) · up [..., I], float32 math, x's dtype out."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def norm_add_norm_ref(h: torch.Tensor, residual: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float,
                      zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm2(r'), r') with r' = residual + norm1(h): float32 math, each step rounded to h's dtype."""
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = w.float() + 1.0 if zero_centered else w.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)

    summed = (residual.float() + norm(h, w1).float()).to(residual.dtype)
    return norm(summed, w2), summed


def _norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x̂ (· w) in float32, rounded to x's dtype (Gemma 4's plain-weight RMSNorm; w None: unscaled)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out if w is None else out * w.float()).to(x.dtype)


def attn_out_norms_ref(a: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                       w_pre2: torch.Tensor | None, router_scale: torch.Tensor | None, root: float, eps: float,
                       router_weight: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(pre_ff(r'), pre_ff_2(r'), x̂(r') · scale · root, r') for r' = residual + post_attn(a), as HF rounds."""
    r = (residual.float() + _norm(a, w_post, eps).float()).to(residual.dtype)
    if w_pre2 is None:
        return _norm(r, w_pre, eps), None, None, r
    router = ((_norm(r, None, eps).float() * router_scale.float()).to(r.dtype).float() * root).to(r.dtype)
    if router_weight is not None:  # the router logits, rounded to the dtype as the projection's output
        router = (router.float() @ router_weight.float().t()).to(r.dtype)
    return _norm(r, w_pre, eps), _norm(r, w_pre2, eps), router, r


def layer_tail_ref(m: torch.Tensor, e: torch.Tensor | None, residual: torch.Tensor, w1: torch.Tensor | None,
                   w2: torch.Tensor | None, w_ff: torch.Tensor, scalar: torch.Tensor | None,
                   w_next: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x = (residual + post_ff(post_ff_1(m) + post_ff_2(e))) · scalar, and next(x); each step rounded to the dtype."""
    dt = residual.dtype
    h = m if e is None else (_norm(m, w1, eps).float() + _norm(e, w2, eps).float()).to(dt)
    x = (residual.float() + _norm(h, w_ff, eps).float()).to(dt)
    if scalar is not None:
        x = (x.float() * scalar.float()).to(dt)
    return x, (_norm(x, w_next, eps) if w_next is not None else None)


def gemma4_route_ref(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Gemma4TextRouter tail: float32 softmax, top-k, / sum, · per_expert_scale[ids]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights * per_expert_scale.float()[ids], ids


def gemma4_qkv_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                             k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k) normed and neox-rotated on the first 2 · cos.shape[-1] dims, v normed unscaled: [T, H, D] each."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = cos.shape[-1]
        xf = x.float()
        a, b = xf[..., :half], xf[..., half:2 * half]
        c, s = cos.float()[:, None], sin.float()[:, None]
        return torch.cat((a * c - b * s, b * c + a * s, xf[..., 2 * half:]), dim=-1).to(x.dtype)

    return rotate(_norm(q, q_weight, eps)), rotate(_norm(k, k_weight, eps)), _norm(v, None, eps)


def softcap_ref(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(logits / cap) in float32."""
    return torch.tanh(logits.float() / cap) * cap


def gemma_gemv_ref(kind: str, x: torch.Tensor, weight: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """``geglu``: down(gelu_tanh(gate) · up) with the GeGLU rounded to x's dtype, out in x's dtype;
    ``softcap``: cap · tanh(x @ W^T rounded to x's dtype), float32. float32 products."""
    if kind == "geglu":
        h = gelu_tanh_and_mul_ref(x).float()
        return (h @ weight.float().t()).to(x.dtype)
    y = (x.float() @ weight.float().t()).to(x.dtype)
    return softcap_ref(y, cap)
