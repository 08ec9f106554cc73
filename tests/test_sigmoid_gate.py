"""``sigmoid_gate_`` (the fused output gate of the cuDNN prefill path) against ``out * torch.sigmoid(gate)``."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels.triton.gate import sigmoid_gate_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 16), (33, 3, 60), (70, 2, 256)])
def test_sigmoid_gate_matches_torch(dtype, tokens, heads, dim):
    """In place on a strided x, the gate a per-head half of a [query | gate] projection, as Qwen's attention has."""
    g = torch.Generator().manual_seed(tokens + dim)
    proj = (torch.randn(tokens, heads, 2 * dim, generator=g) * 3).to(dtype)
    gate = proj[..., dim:]  # [T, H, D] strided view
    out = torch.randn(heads, tokens, dim, generator=g).to(dtype).transpose(0, 1)  # [T, H, D], SDPA-like strides
    want = out * torch.sigmoid(gate)
    got = sigmoid_gate_(out, gate)
    assert got.data_ptr() == out.data_ptr()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # each factor rounded to the dtype as torch rounds it; the interpreter's bf16 casts truncate, so up to
        # one ulp per rounding there (the GPU rounds to nearest even)
        ulps = 1 if dtype == torch.float16 else 2
        ulp = torch.finfo(dtype).eps
        assert ((got.float() - want.float()).abs() <= ulps * ulp * want.float().abs() + 1e-6).all()
        if dtype == torch.float16:
            assert (got == want).float().mean() > 0.99


def test_sigmoid_gate_rejects_mismatched_shapes():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError):
        sigmoid_gate_(x, torch.zeros(4, 2, 9))
