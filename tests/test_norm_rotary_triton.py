"""Triton RMSNorm (plain, fused residual add, gated) and in-place rotary against the torch references.

Runs under TRITON_INTERPRET=1 on CPU at odd sizes; on a CUDA machine the same tests run compiled.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels import norm as ref_norm  # noqa: E402
from armillary.kernels.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq  # noqa: E402
from armillary.kernels.triton.norm import fused_add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from armillary.kernels.triton.rotary import apply_rotary_, rotary_cos_sin_cache, rotary_embedding_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 2e-3


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("dim", [60, 1])
def test_rms_norm_matches_reference(dtype, zero_centered, dim):
    x, w = randn(63, dim, dtype=dtype), randn(dim, seed=1, dtype=dtype) * 0.1
    out = rms_norm(x, w, 1e-6, zero_centered)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref_norm.rms_norm(x, w, 1e-6, zero_centered)) < tol(dtype)


def test_rms_norm_on_strided_heads():
    """q/k norms read [T, heads, D] views of a wider projection output without a copy."""
    proj = randn(7, 5 * 24, dtype=torch.float16)
    heads = proj.view(7, 5, 24)[:, 1:4]  # [7, 3, 24], token stride 120, head stride 24
    w = randn(24, seed=2, dtype=torch.float16)
    out = rms_norm(heads, w, 1e-6, True)
    assert out.shape == (7, 3, 24)
    assert rel_err(out, ref_norm.rms_norm(heads, w, 1e-6, True)) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_unfused(dtype):
    x, res = randn(17, 60, dtype=dtype), randn(17, 60, seed=3, dtype=dtype)
    w = randn(60, seed=4, dtype=dtype) * 0.1
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6, zero_centered=True)
    summed = x + res  # the model dtype's rounding, as the unfused model computes it
    assert torch.equal(new_res, summed)
    assert rel_err(normed, ref_norm.rms_norm(summed, w, 1e-6, True)) < tol(dtype)
    assert torch.equal(res, randn(17, 60, seed=3, dtype=dtype))  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [None, 20])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_matches_reference(dtype, group_size, norm_before_gate):
    x, gate = randn(9, 60, dtype=dtype), randn(9, 60, seed=5, dtype=dtype)
    w = randn(60, seed=6, dtype=dtype)
    out = gated_rms_norm(x, gate, w, 1e-5, group_size, norm_before_gate)
    ref = ref_norm.gated_rms_norm(x, gate, w, 1e-5, group_size, norm_before_gate)
    assert out.shape == x.shape and rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_on_strided_head_views(dtype):
    # the GDN output norm: x [T, H, D] contiguous, gate a column slice of the projection viewed per head
    x = randn(7, 3, 20, dtype=dtype)
    projected = randn(7, 100, seed=8, dtype=dtype)
    gate = projected[:, 30:90].view(7, 3, 20)  # strides (100, 20, 1): no [N, D] view without a copy
    w = randn(20, seed=9, dtype=dtype)
    out = gated_rms_norm(x, gate, w, 1e-6)
    ref = ref_norm.gated_rms_norm(x, gate.contiguous(), w, 1e-6)
    assert out.shape == x.shape and out.is_contiguous() and rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_cache_partial_in_place(dtype, interleaved):
    """rotary_dim 20 of head_dim 36 (half 10, not a power of two); q a strided view of a fused projection."""
    tokens, hq, hk, head_dim, rot = 13, 3, 1, 36, 20
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.tensor([5, 0, 99, 3, 3, 17, 64, 1, 2, 8, 40, 77, 11], device=DEVICE)
    inv_freq = rotary_inv_freq(rot, 10000.0, DEVICE)
    cos, sin = rotary_cos_sin(positions, inv_freq)
    ref_q, ref_k = apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    rotary_embedding_(q, k, positions, rotary_cos_sin_cache(128, inv_freq), interleaved)
    assert rel_err(q, ref_q) < tol(dtype) and rel_err(k, ref_k) < tol(dtype)
    assert torch.equal(q[..., rot:], ref_q[..., rot:])  # dims past rotary_dim untouched
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # v untouched


def test_rotary_per_token_cos_sin_without_k():
    q = randn(4, 2, 16, dtype=torch.float16)
    cos, sin = rotary_cos_sin(torch.arange(4, device=DEVICE) * 7, rotary_inv_freq(8, 1e6, DEVICE))
    ref = apply_rotary(q, cos, sin)
    apply_rotary_(q, None, cos, sin)
    assert rel_err(q, ref) < 2e-3


def test_rotary_rejects_rotary_dim_past_head_dim():
    q = randn(2, 1, 8)
    cos, sin = rotary_cos_sin(torch.arange(2, device=DEVICE), rotary_inv_freq(16, 1e4, DEVICE))
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_(q, None, cos, sin)
