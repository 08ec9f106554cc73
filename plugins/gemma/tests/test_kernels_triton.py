"""The plugin's Triton GeGLU and norm-add-norm, and core's Triton MoE with Gemma's gelu-tanh experts, against
fp32 references at odd sizes (on the CPU through Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels.moe import fused_moe as fused_moe_ref
from armillary.kernels.moe import softmax_topk
from armillary_gemma.ops.geglu import gelu_tanh_and_mul
from armillary_gemma.ops.naive import gelu_tanh_and_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 7), (5, 1030), (3, 96)])
def test_geglu_matches_the_reference(rows, inter, dtype):
    gen = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(DEVICE, dtype)
    got, want = gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_geglu_reads_a_strided_row_view_and_refuses_bad_shapes():
    x = torch.randn(4, 40, device=DEVICE)[:, :20]  # row stride 40, unit last stride
    torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x))
    with pytest.raises(ValueError, match="2I"):
        gelu_tanh_and_mul(torch.randn(3, 5, device=DEVICE))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("path", ["gemv", "decode", "grouped"])
def test_triton_moe_with_gelu_tanh_experts(path):
    from armillary.kernels.triton.moe import fused_moe

    gen = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, k = 5, 24, 20, 6, 2
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.3).to(DEVICE)
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=gen).to(DEVICE), k, True)
    got = fused_moe(x, w13, w2, weights, ids, "gelu_pytorch_tanh", path=path)
    want = fused_moe_ref(x, w13, w2, weights, ids, "gelu_pytorch_tanh")
    assert _rel(got, want) < 1e-4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,dim", [(1, 5376), (7, 100), (3, 33)])
def test_norm_add_norm_matches_the_reference(rows, dim, dtype, zero_centered):
    from armillary_gemma.ops.naive import norm_add_norm_ref
    from armillary_gemma.ops.norm import norm_add_norm_triton

    gen = torch.Generator().manual_seed(rows + dim)
    h, r = (torch.randn(rows, dim, generator=gen) * 3).to(DEVICE, dtype), torch.randn(rows, dim, generator=gen).to(
        DEVICE, dtype)
    w1, w2 = (torch.rand(dim, generator=gen) - 0.5).to(DEVICE, dtype), (torch.rand(dim, generator=gen) + 0.5).to(
        DEVICE, dtype)
    out, new_r = norm_add_norm_triton(h, r, w1, w2, 1e-6, zero_centered)
    want_out, want_r = norm_add_norm_ref(h, r, w1, w2, 1e-6, zero_centered)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert _rel(new_r, want_r) < tol and _rel(out, want_out) < tol
