"""The fused MoE entry (residual add + RMSNorm + router GEMV + softmax top-k with a shared expert)
against the unfused reference ops, under TRITON_INTERPRET=1 on CPU at odd sizes."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels import moe as ref_moe  # noqa: E402
from armillary.kernels import norm as ref_norm  # noqa: E402
from armillary.kernels import ops  # noqa: E402
from armillary.kernels.triton.norm_router import add_norm_route  # noqa: E402
from armillary.kernels.triton.skinny_gemm import ticket_buffer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def reference(h, residual, norm_w, eps, router, top_k, renormalize, num_shared, zero_centered):
    """The unfused model math, each step rounded to the model dtype where the unfused ops store it."""
    r = h + residual
    x = ref_norm.rms_norm(r, norm_w, eps, zero_centered)
    logits = (x.float() @ router.float().t()).to(h.dtype)
    num_experts = router.shape[0] - num_shared
    weights, ids = ref_moe.softmax_topk(logits[:, :num_experts], top_k, renormalize)
    if num_shared:
        weights = torch.cat([weights, torch.sigmoid(logits[:, num_experts:].float())], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=1)
    return x, r, weights, ids


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("num_shared,renormalize,zero_centered", [(1, True, True), (0, False, False), (1, False, True)])
@pytest.mark.parametrize("block_n", [4, 16])
def test_matches_unfused_ops(dtype, tokens, num_shared, renormalize, zero_centered, block_n):
    hidden, experts, top_k = 60, 13, 3
    h, residual = randn(tokens, hidden, seed=1, dtype=dtype), randn(tokens, hidden, seed=2, dtype=dtype)
    norm_w = randn(hidden, seed=3, dtype=dtype, scale=0.1)
    router = randn(experts + num_shared, hidden, seed=4, dtype=dtype, scale=0.3)
    want = reference(h, residual, norm_w, 1e-6, router, top_k, renormalize, num_shared, zero_centered)
    for _ in range(2):  # a second call finds its tickets back at zero
        got = add_norm_route(h, residual, norm_w, 1e-6, router, top_k, renormalize, num_shared, zero_centered,
                             config={"BLOCK_N": block_n})
        assert got is not None
        x, r, weights, ids = got
        assert torch.equal(r, want[1])
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        assert ((x.float() - want[0].float()).abs().max() / want[0].float().abs().max()).item() < tol
        assert torch.equal(ids.long(), want[3].long())
        assert torch.allclose(weights, want[2], rtol=1e-5, atol=1e-6)
        assert int(ticket_buffer(h.device, tokens)[:tokens].abs().sum()) == 0


def test_ops_dispatch_matches_the_reference_backend():
    h, residual = randn(2, 48, seed=5), randn(2, 48, seed=6)
    norm_w, router = randn(48, seed=7, scale=0.1), randn(9, 48, seed=8, scale=0.3)
    ops.set_backend("triton")
    try:
        fused = ops.add_rms_norm_route(h, residual, norm_w, 1e-6, router, 2, True)
    finally:
        ops.set_backend("auto")
    plain = ops.add_rms_norm_route(h, residual, norm_w, 1e-6, router, 2, True) if DEVICE == "cpu" else None
    if plain is not None:
        for a, b in zip(fused, plain):
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def test_rejects_mismatched_shapes():
    h = randn(1, 32)
    with pytest.raises(ValueError, match="add_norm_route"):
        add_norm_route(h, h, randn(32), 1e-6, randn(5, 30), 2, True)
