"""The NVFP4 reference (armillary.kernels.fp4): the e2m1 table and nibble order, its quantizer against the tests' own, and the reference GEMM / MoE against dense math on the dequantized weights, odd sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from armillary.kernels import fp4, ops
from armillary.kernels import moe as dense_moe
from armillary.kernels.dispatch import core_registry, resolve_dispatch
from tests.quantization.nvfp4_writer import dequantize as ref_dequantize
from tests.quantization.nvfp4_writer import quantize as ref_quantize


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_codes_decode_low_nibble_first_with_the_sign_in_bit_3():
    packed = torch.tensor([[0x21, 0xF9, 0x7E, 0x80]], dtype=torch.uint8)
    assert fp4.decode_e2m1(packed).tolist() == [[0.5, 1.0, -0.5, -6.0, -4.0, 6.0, 0.0, -0.0]]
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    assert torch.equal(fp4.unpack_codes(fp4.pack_codes(codes)), codes)
    assert fp4.pack_codes(codes)[0, :2].tolist() == [0x10, 0x32]


@pytest.mark.parametrize("shape", [(37, 80), (3, 5, 48), (1, 16)])
def test_quantizer_matches_the_tests_quantizer_and_round_trips(shape):
    w = randn(*shape, seed=len(shape), scale=3.0)
    w[..., 0, :16] = 0  # an all-zero group keeps a zero scale
    packed, scale, g = fp4.quantize_nvfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scale.shape == (*shape[:-1], shape[-1] // 16)
    flat_w, flat_p, flat_s = w.reshape(-1, *shape[-2:]), packed.reshape(-1, *packed.shape[-2:]), \
        scale.reshape(-1, *scale.shape[-2:])
    for i, (wi, pi, si, gi) in enumerate(zip(flat_w, flat_p, flat_s, g.reshape(-1))):
        p, s, rg = ref_quantize(wi)
        assert torch.equal(p, pi) and torch.equal(s.view(torch.uint8), si.view(torch.uint8)), i
        assert rg == gi.item()
        back = fp4.dequantize(pi, si, fp4.row_global_scale(gi, wi.shape[0]))
        assert torch.allclose(back, ref_dequantize(p, s, rg), rtol=1e-6, atol=0)
        # e2m1 spacing is 0.5 / 1 / 2 below 2 / 4 / 6 (in units of scale · global): at most half of it off
        unit = si.float().repeat_interleave(16, 1) * gi
        step = torch.where(back.abs() < 2 * unit, 0.5, torch.where(back.abs() < 4 * unit, 1.0, 2.0)) * unit
        group_max = wi.abs().reshape(wi.shape[0], -1, 16).amax(-1).repeat_interleave(16, 1)
        assert ((back - wi).abs() <= step / 2 + group_max * 2 ** -3 + 1e-7).all()  # + e4m3 rounding of the scale
        assert torch.equal(fp4.quantize_nvfp4(back, gi)[0], pi)  # the dequantized weight is a fixed point
    assert (fp4.dequantize(packed, scale, fp4.row_global_scale(g, shape[-2]))[..., 0, :16] == 0).all()


def _per_row_globals(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 1e-2 + 1e-3  # shards' own scales


@pytest.mark.parametrize("m,n,k", [(1, 7, 16), (5, 33, 48), (19, 64, 112)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_is_the_dense_product_of_the_dequantized_weight(m, n, k, dtype):
    packed, scale, _ = fp4.quantize_nvfp4(randn(n, k, seed=1))
    glob = _per_row_globals(n, 2)
    x, bias = randn(m, k, seed=3).to(dtype), randn(n, seed=4).to(dtype)
    w = fp4.dequantize(packed, scale, glob)  # fp32
    got = ops.fp4_linear(x, packed, scale, glob, bias)
    want = (x.float() @ w.T + bias.float()).to(dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).norm() / want.float().norm() < tol
    assert torch.equal(fp4.linear(x, packed, scale, glob, None), F.linear(x, w.to(dtype)))


@pytest.mark.parametrize("gated", [True, False])
def test_reference_moe_is_the_dense_moe_of_the_dequantized_experts(gated):
    e, h, inter, t, k = 5, 48, 32, 11, 2
    rows = 2 * inter if gated else inter
    w13p, w13s, _ = fp4.quantize_nvfp4(randn(e, rows, h, seed=5))
    w2p, w2s, _ = fp4.quantize_nvfp4(randn(e, h, inter, seed=6))
    g13, g2 = _per_row_globals(e * rows, 7).reshape(e, rows), _per_row_globals(e * h, 8).reshape(e, h)
    x = randn(t, h, seed=9)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(10))
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(11))
    got = ops.fp4_fused_moe(x, w13p, w13s, g13, w2p, w2s, g2, weights, ids, "silu")
    want = dense_moe.fused_moe(x, fp4.dequantize(w13p, w13s, g13), fp4.dequantize(w2p, w2s, g2), weights, ids, "silu")
    assert (got - want).norm() / want.norm() < 1e-5


def test_fp4_interfaces_have_core_references_on_every_backend():
    for backend in ("auto", "reference", "triton"):
        table = resolve_dispatch(core_registry(), None, "cpu", backend)
        assert table.chain("fp4_linear")[-1].spec.name == "torch_fp4_linear"
        assert table.chain("fp4_fused_moe")[-1].spec.name == "torch_fp4_fused_moe"


def test_misshapen_fp4_tensors_are_named():
    packed, scale, g = fp4.quantize_nvfp4(randn(8, 32))
    rows = fp4.row_global_scale(g, 8)
    assert fp4.check_shapes(packed, scale, rows) == 32
    with pytest.raises(ValueError, match="layer.x: group scales"):
        fp4.check_shapes(packed, scale[:, :1], rows, "layer.x")
    with pytest.raises(ValueError, match="global scale"):
        fp4.check_shapes(packed, scale, g.reshape(1), "layer.x")
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4.quantize_nvfp4(randn(4, 24))
