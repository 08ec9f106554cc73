"""Gemma 4's norm chains in one Triton launch each: after attention (residual add, MLP / expert / router inputs)
and at a layer's end (post-feedforward norms, residual add, layer scalar, the next layer's input norm).

``attn_out_norms``: ``r' = r + post_attn(a)``, then from r' the dense MLP's input ``pre_ff(r')``, the
experts' ``pre_ff_2(r')`` and the router's ``x̂(r') · scale · H^-½`` (five launches unfused); at decode
sizes it also takes the router's projection (a 128 x H GEMV), so the router logits come out of it too.
``layer_tail``: ``x = (r + post_ff(post_ff_1(m) + post_ff_2(e))) · layer_scalar`` and ``next(x)`` (the
next layer's input norm, or the final norm): seven launches unfused. Without experts ``e`` the MLP
output goes to ``post_ff`` directly; without a scalar / next weight those steps are left out (the
per-layer-input models finish their layer in a second call). Every intermediate is rounded to the
model dtype where transformers' unfused modules round it; the references are in ``naive``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue

ROUTER_EXPERTS = 4  # router logits a program (Gemma-4-26B-A4B: 128 experts, 32 programs a row)
ROUTER_MAX_ROWS = 8  # decode sizes fold the router GEMV into the norms; longer steps keep the GEMM


@triton.jit
def _normed(x, w, dim, eps):
    """x̂ · w of one float32 row (masked lanes zero), float32."""
    return x * tl.rsqrt(tl.sum(x * x, 0) / dim + eps) * w


@triton.jit
def _attn_out_norms_kernel(a_ptr, r_ptr, w_post_ptr, w_pre_ptr, w_pre2_ptr, scale_ptr, router_w_ptr, mlp_ptr,
                           expert_ptr, router_ptr, r_out_ptr, dim, num_experts, stride_a, stride_r, stride_rw, eps,
                           root, HAS_MOE: tl.constexpr, HAS_ROUTER: tl.constexpr, EXPERTS: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, expert blocks): outputs [T, D] contiguous, written by each row's first program.

    HAS_ROUTER: ``router_ptr`` gets the router logits [T, E] (the router projection of the router input,
    rounded to the model dtype as its GEMM's output), ``EXPERTS`` experts a program, instead of the
    router input itself. Every program recomputes its row's norms (a few KB, cached) for its experts.
    """
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) == 0
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dt = r_out_ptr.dtype.element_ty
    a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
    w_post = tl.load(w_post_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    summed = (r + _normed(a, w_post, dim, eps).to(dt).to(tl.float32)).to(dt)
    s = summed.to(tl.float32)
    x_hat = s * tl.rsqrt(tl.sum(s * s, 0) / dim + eps)  # [BLOCK]
    if first:
        tl.store(r_out_ptr + row * dim + cols, summed, mask=ok)
        w_pre = tl.load(w_pre_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(mlp_ptr + row * dim + cols, (x_hat * w_pre).to(dt), mask=ok)
    if HAS_MOE:
        if first:
            w_pre2 = tl.load(w_pre2_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(expert_ptr + row * dim + cols, (x_hat * w_pre2).to(dt), mask=ok)
        scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        # the router's unscaled norm, then · scale, then · H^-½: each product rounded as torch rounds it
        routed = ((x_hat.to(dt).to(tl.float32) * scale).to(dt).to(tl.float32) * root).to(dt)
        if HAS_ROUTER:
            experts = tl.program_id(1) * EXPERTS + tl.arange(0, EXPERTS)
            e_ok = experts < num_experts
            w_ptrs = router_w_ptr + experts[:, None].to(tl.int64) * stride_rw + cols[None, :]
            w = tl.load(w_ptrs, mask=e_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)  # [EXPERTS, BLOCK]
            logits = tl.sum(w * routed.to(tl.float32)[None, :], axis=1)  # [EXPERTS]
            tl.store(router_ptr + row * num_experts + experts, logits.to(dt), mask=e_ok)
        elif first:
            tl.store(router_ptr + row * dim + cols, routed, mask=ok)


@triton.jit
def _layer_tail_kernel(m_ptr, e_ptr, r_ptr, w1_ptr, w2_ptr, w_ff_ptr, scalar_ptr, w_next_ptr, x_out_ptr,
                       next_ptr, dim, stride_m, stride_e, stride_r, eps,
                       HAS_MOE: tl.constexpr, HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dt = x_out_ptr.dtype.element_ty
    h = tl.load(m_ptr + row * stride_m + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_MOE:
        w1 = tl.load(w1_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        e = tl.load(e_ptr + row * stride_e + cols, mask=ok, other=0.0).to(tl.float32)
        h1 = _normed(h, w1, dim, eps).to(dt).to(tl.float32)
        h2 = _normed(e, w2, dim, eps).to(dt).to(tl.float32)
        h = (h1 + h2).to(dt).to(tl.float32)
    w_ff = tl.load(w_ff_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    x = (r + _normed(h, w_ff, dim, eps).to(dt).to(tl.float32)).to(dt)
    if HAS_SCALAR:
        x = (x.to(tl.float32) * tl.load(scalar_ptr).to(tl.float32)).to(dt)
    tl.store(x_out_ptr + row * dim + cols, x, mask=ok)
    if HAS_NEXT:
        w_next = tl.load(w_next_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(next_ptr + row * dim + cols, _normed(x.to(tl.float32), w_next, dim, eps).to(dt), mask=ok)


def _rows(*tensors: torch.Tensor | None) -> tuple[int, int]:
    """(T, D) of [T, D] operands with unit last stride (None skipped)."""
    shape = tensors[0].shape
    for t in tensors:
        if t is not None and (t.dim() != 2 or t.shape != shape or t.stride(1) != 1):
            raise ValueError(f"Gemma 4 norms: operands {[None if t is None else tuple(t.shape) for t in tensors]} "
                             "must be [T, D] rows with unit last stride")
    return shape[0], shape[1]


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4


def attn_out_norms_triton(a: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                          w_pre2: torch.Tensor | None, router_scale: torch.Tensor | None, root: float, eps: float,
                          router_weight: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """a, residual: [T, D] -> (mlp_in, expert_in, router_in, r'); the middle two None without ``w_pre2``.
    With ``router_weight`` [E, D] (unit last stride) the third is the router logits [T, E] instead."""
    rows, dim = _rows(a, residual)
    moe = w_pre2 is not None
    router = moe and router_weight is not None
    if router and (router_weight.dim() != 2 or router_weight.shape[1] != dim or router_weight.stride(1) != 1
                   or router_weight.dtype != residual.dtype):
        raise ValueError(f"attn_out_norms: router weight {tuple(router_weight.shape)} must be [E, {dim}] rows")
    experts = router_weight.shape[0] if router else 0
    r_out, mlp_in = torch.empty_like(residual), torch.empty_like(residual)
    expert_in = torch.empty_like(residual) if moe else None
    router_out = None
    if moe:
        router_out = residual.new_empty(rows, experts) if router else torch.empty_like(residual)
    if rows:
        block = next_power_of_2(dim)
        per_program = min(ROUTER_EXPERTS, next_power_of_2(max(experts, 1)))
        grid = (rows, cdiv(experts, per_program) if router else 1)
        _attn_out_norms_kernel[grid](
            a, residual, w_post, w_pre, w_pre2 if moe else w_pre, router_scale if moe else w_pre,
            router_weight if router else w_pre, mlp_in, expert_in if moe else mlp_in,
            router_out if moe else mlp_in, r_out, dim, experts, a.stride(0), residual.stride(0),
            router_weight.stride(0) if router else 0, float(eps), float(root), HAS_MOE=moe, HAS_ROUTER=router,
            EXPERTS=per_program, BLOCK=block, num_warps=_warps(block), **launch_options(a.device))
    return mlp_in, expert_in, router_out, r_out


def layer_tail_triton(m: torch.Tensor, e: torch.Tensor | None, residual: torch.Tensor, w1: torch.Tensor | None,
                      w2: torch.Tensor | None, w_ff: torch.Tensor, scalar: torch.Tensor | None,
                      w_next: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """m (MLP out), e (experts out or None), residual: [T, D]; scalar: [1] -> (x, next_norm(x) or None)."""
    rows, dim = _rows(m, e, residual)
    x = torch.empty_like(residual)
    nxt = torch.empty_like(residual) if w_next is not None else None
    if rows:
        block = next_power_of_2(dim)
        moe = e is not None
        _layer_tail_kernel[(rows,)](
            m, e if moe else m, residual, w1 if moe else w_ff, w2 if moe else w_ff, w_ff,
            scalar if scalar is not None else w_ff, w_next if w_next is not None else w_ff, x,
            nxt if nxt is not None else x, dim, m.stride(0), (e if moe else m).stride(0), residual.stride(0),
            float(eps), HAS_MOE=moe, HAS_SCALAR=scalar is not None, HAS_NEXT=w_next is not None, BLOCK=block,
            num_warps=_warps(block), **launch_options(m.device))
    return x, nxt


def attn_out_norms(a: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                   w_pre2: torch.Tensor | None, router_scale: torch.Tensor | None, root: float, eps: float,
                   router_weight: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One launch where Triton serves ``a``; core's norm ops elsewhere (the CPU reference path). With
    ``router_weight`` the third output is the router logits (in the launch at decode sizes, ``ops.linear``
    after it otherwise)."""
    if ops.use_triton(a):
        fold = router_weight is not None and a.shape[0] <= ROUTER_MAX_ROWS  # prefill: the GEMM, not T x E programs
        out = attn_out_norms_triton(a, residual, w_post, w_pre, w_pre2, router_scale, root, eps,
                                    router_weight if fold else None)
    else:
        out = attn_out_norms_unfused(a, residual, w_post, w_pre, w_pre2, router_scale, root, eps)
        fold = False
    if router_weight is None or fold or out[2] is None:
        return out
    return out[0], out[1], ops.linear(out[2], router_weight), out[3]


def attn_out_norms_unfused(a: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                           w_pre2: torch.Tensor | None, router_scale: torch.Tensor | None, root: float, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The same through core's norm ops and torch products (five launches with experts on the GPU)."""
    mlp_in, r = ops.add_rms_norm(ops.rms_norm(a, w_post, eps), residual, w_pre, eps)
    if w_pre2 is None:
        return mlp_in, None, None, r
    unit = torch.ones_like(w_pre)
    return mlp_in, ops.rms_norm(r, w_pre2, eps), ops.rms_norm(r, unit, eps) * router_scale * root, r


def layer_tail(m: torch.Tensor, e: torch.Tensor | None, residual: torch.Tensor, w1: torch.Tensor | None,
               w2: torch.Tensor | None, w_ff: torch.Tensor, scalar: torch.Tensor | None, w_next: torch.Tensor | None,
               eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch where Triton serves ``m``; core's norm ops and torch elementwise ops elsewhere."""
    if ops.use_triton(m):
        return layer_tail_triton(m, e, residual, w1, w2, w_ff, scalar, w_next, eps)
    return layer_tail_unfused(m, e, residual, w1, w2, w_ff, scalar, w_next, eps)


def layer_tail_unfused(m: torch.Tensor, e: torch.Tensor | None, residual: torch.Tensor, w1: torch.Tensor | None,
                       w2: torch.Tensor | None, w_ff: torch.Tensor, scalar: torch.Tensor | None,
                       w_next: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same through core's norm ops and torch elementwise ops (seven launches with experts on the GPU)."""
    h = m if e is None else ops.rms_norm(m, w1, eps) + ops.rms_norm(e, w2, eps)
    x = residual + ops.rms_norm(h, w_ff, eps)
    if scalar is not None:
        x = x * scalar
    return x, (ops.rms_norm(x, w_next, eps) if w_next is not None else None)
