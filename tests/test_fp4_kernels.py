"""The Triton NVFP4 kernels (skinny decode GEMM, the two prefill tiles, fused MoE GEMV / grouped, the Blackwell quantizer and scaled GEMM) against the fp32 dequantizing reference, odd sizes, interpreter."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from armillary.kernels import fp4 as ref
from armillary.kernels.fp8 import dequantize as fp8_dequantize
from armillary.kernels.fp8 import quantize_act_groups
from armillary.kernels.triton import fp4_blackwell, fp4_gemm, fp4_gemv, fp4_moe

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weight(n: int, k: int, seed: int = 0):
    """An NVFP4 weight whose rows carry distinct global scales (as stacked q / k / v shards do)."""
    torch.manual_seed(seed)
    packed, scale, g = ref.quantize_nvfp4(torch.randn(n, k))
    return packed, scale, ref.row_global_scale(g, n) * torch.linspace(0.5, 2.0, n)


@triton.jit
def _decode_all_kernel(out_ptr):
    codes = tl.arange(0, 16)  # int32
    tl.store(out_ptr + tl.arange(0, 16), fp4_gemv.e2m1_bits(codes << 28) * fp4_gemv.FOLD * fp4_gemv.FOLD)


def test_bit_decode_gives_every_e2m1_value_including_the_subnormal_half():
    out = torch.empty(16)
    _decode_all_kernel[(1,)](out)
    want = torch.tensor(E2M1 + [-v for v in E2M1])
    assert torch.equal(out, want)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", [(60, 96), (33, 160)])
def test_skinny_gemm_matches_reference(m, n, k):
    packed, scale, g = _weight(n, k)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    out = fp4_gemm.fp4_linear(x, packed, scale, g, bias)
    assert _ratio(out, ref.linear(x, packed, scale, g, bias)) < 1e-5


@pytest.mark.parametrize("m,tiles", [(1, dict(BLOCK_N=16, BLOCK_K=32, K_TILES=1)), (5, dict(BLOCK_K=32, K_TILES=2))])
def test_skinny_split_k_last_arriver_sum(m, tiles):
    n, k = 45, 160
    packed, scale, g = _weight(n, k, seed=2)
    x = torch.randn(m, k)
    cfg = dict(tiles, split_k=triton.cdiv(triton.cdiv(k, tiles["BLOCK_K"]), tiles["K_TILES"]))
    want = ref.linear(x, packed, scale, g, None)
    for _ in range(2):  # the second call starts from the reset tickets
        assert _ratio(fp4_gemv.fp4_skinny_gemm(x, packed, scale, g, None, cfg), want) < 1e-5
    assert cfg["split_k"] > 1


def test_skinny_half_rows():
    """16-bit activations (fp16: the interpreter's bf16 tl.dot is wrong; bf16 runs in bench/nvfp4_gpu_checks.py)."""
    packed, scale, g = _weight(60, 96, seed=3)
    x = torch.randn(3, 96).half()
    out = fp4_gemm.fp4_linear(x, packed, scale, g, None)
    assert out.dtype == torch.float16
    assert _ratio(out, ref.linear(x.float(), packed, scale, g, None)) < 1e-2


@pytest.mark.parametrize("variant", ["bf16", "dequant"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_prefill_bf16_tile_and_dequant_match_reference(variant, dtype, tol):
    packed, scale, g = _weight(60, 96, seed=4)
    x = torch.randn(70, 96).to(dtype)
    bias = torch.randn(60).to(dtype)
    out = fp4_gemm.fp4_linear(x, packed, scale, g, bias, config=dict(variant=variant))
    assert _ratio(out, ref.linear(x.float(), packed, scale, g, bias.float())) < tol


def test_dequantize_kernel_matches_reference():
    packed, scale, g = _weight(37, 160, seed=9)
    stacked = (packed.expand(3, -1, -1), scale.expand(3, -1, -1), g.expand(3, -1))  # [E, N, .]: experts
    out = fp4_gemv.dequantize(*stacked, torch.float32)
    assert out.shape == (3, 37, 160)
    assert _ratio(out, ref.dequantize(*stacked)) < 1e-6


def _fp8_variant_emulation(x, packed, scale, g, bias, block_k=128):
    """The fp8 tile in torch: x per row and 128 columns to e4m3, the weight per tile re-rounded to e4m3 as
    e2m1 · s / r · 64 (r: the row's largest group scale in the tile), products scaled back."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    xq, xs = quantize_act_groups(x.float(), block_k)
    xd = fp8_dequantize(xq, xs, 1, block_k)  # [M, K]
    vals = ref.decode_e2m1(packed)  # [N, K]
    s = scale.float()
    out = torch.zeros(x.shape[0], n)
    for k0 in range(0, k, block_k):
        sg = s[:, k0 // 16:(k0 + block_k) // 16]  # [N, G]
        r = sg.amax(dim=1).clamp(min=1e-30)  # [N]
        wt = vals[:, k0:k0 + block_k] * sg.repeat_interleave(16, dim=1) / r[:, None] * 64
        w8 = wt.to(torch.float8_e4m3fn).float()
        out += (xd[:, k0:k0 + block_k] @ w8.T) * (r / 64)[None, :]
    return out * g[None, :] + bias


def test_prefill_fp8_tile_matches_its_emulation():
    packed, scale, g = _weight(40, 160, seed=5)
    x = torch.randn(70, 160)
    bias = torch.randn(40)
    out = fp4_gemm.fp4_linear(x, packed, scale, g, bias, config=dict(variant="fp8"))
    assert _ratio(out, _fp8_variant_emulation(x, packed, scale, g, bias)) < 1e-5
    assert 1e-3 < _ratio(out, ref.linear(x, packed, scale, g, bias)) < 6e-2  # the activation rounding shows


def test_linear_names_the_misfit_tensor():
    packed, scale, g = _weight(60, 96)
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="group scales"):
        fp4_gemm.fp4_linear(x, packed, scale[:, :5], g, None)
    with pytest.raises(ValueError, match="global scale"):
        fp4_gemm.fp4_linear(x, packed, scale, g[:7], None)
    with pytest.raises(ValueError, match="packed weight"):
        fp4_gemm.fp4_linear(torch.randn(2, 80), packed, scale, g, None)


def _experts(e: int, h: int, inter: int, gated: bool, seed: int = 6):
    torch.manual_seed(seed)
    w13 = torch.randn(e, (2 if gated else 1) * inter, h)
    w2 = torch.randn(e, h, inter)
    p13, s13, g13 = ref.quantize_nvfp4(w13)
    p2, s2, g2 = ref.quantize_nvfp4(w2)
    return p13, s13, ref.row_global_scale(g13, w13.shape[1]), p2, s2, ref.row_global_scale(g2, h)


@pytest.mark.parametrize("t,gated,activation,grouped", [
    (1, True, "silu", False), (3, False, "gelu", False), (17, True, "silu", True), (3, True, "relu", True),
    (17, True, "silu", "dequant"),
])
def test_fused_moe_matches_reference(t, gated, activation, grouped):
    e, h, inter, top_k = 5, 96, 48, 2
    weights = _experts(e, h, inter, gated)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
    topw = torch.rand(t, top_k)
    out = fp4_moe.fp4_fused_moe(x, *weights[:3], *weights[3:], topw, ids, activation, grouped=grouped)
    want = ref.fused_moe(x, *weights[:3], *weights[3:], topw, ids, activation)
    assert _ratio(out, want) < 1e-5


def test_fused_moe_names_misfit_scales():
    weights = list(_experts(3, 32, 32, True))
    weights[4] = weights[4][:, :, :1]
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="w2 scales"):
        fp4_moe.fp4_fused_moe(x, *weights, torch.rand(1, 2), torch.tensor([[0, 1]]), "silu")


def test_blackwell_activation_quantizer_is_the_reference_per_row():
    torch.manual_seed(7)
    x = torch.randn(5, 96) * torch.tensor([0.01, 1.0, 30.0, 2.0, 0.5])[:, None]
    x[1, :16] = 0.0  # an all-zero group keeps a zero scale and zero codes
    q, s, g = fp4_blackwell.quantize_act_nvfp4(x)
    q2, s2, g2 = ref.quantize_nvfp4(x[:, None, :])  # each row its own matrix
    assert torch.equal(q, q2[:, 0]) and torch.equal(g, g2)
    assert torch.equal(s.view(torch.uint8), s2[:, 0].view(torch.uint8))


def test_blackwell_scaled_gemm_is_w4a4():
    """The kernel's loads, masks and epilogue (dot_scaled's operands dequantized under the interpreter)."""
    packed, scale, g = _weight(60, 96, seed=8)
    x = torch.randn(70, 96)
    bias = torch.randn(60)
    q, s, xg = ref.quantize_nvfp4(x[:, None, :])
    want = ref.dequantize(q[:, 0], s[:, 0], xg) @ ref.dequantize(packed, scale, g).T + bias
    out = fp4_blackwell.fp4_linear(x, packed, scale, g, bias)
    assert _ratio(out, want) < 1e-5
    small = fp4_blackwell.fp4_linear(x[:3], packed, scale, g, bias)  # decode rows stay weight-only
    assert _ratio(small, ref.linear(x[:3], packed, scale, g, bias)) < 1e-5
    w16 = fp4_blackwell.fp4_linear(x, packed, scale, g, bias, config=dict(w4a4=False))  # prefill kept W4A16
    assert _ratio(w16, ref.linear(x, packed, scale, g, bias)) < 1e-5


def test_dispatch_prefers_the_native_fp4_gemm_on_blackwell(monkeypatch):
    from armillary.kernels.dispatch import resolve_dispatch
    from armillary.registry import PluginRegistry

    reg = PluginRegistry()
    monkeypatch.setattr(fp4_blackwell, "capability", lambda index: (10, 0))
    assert resolve_dispatch(reg, None, "cuda", capability=(10, 0)).chosen("fp4_linear") == "triton_fp4_linear_blackwell"
    monkeypatch.setattr(fp4_blackwell, "capability", lambda index: (12, 0))
    assert resolve_dispatch(reg, None, "cuda", capability=(12, 0)).chosen("fp4_linear") == "triton_fp4_linear_blackwell"
    assert not fp4_blackwell.native_fp4((12, 1), (3, 6)) and fp4_blackwell.native_fp4((12, 1), (3, 9))
    monkeypatch.setattr(fp4_blackwell, "capability", lambda index: (9, 0))
    sm90 = resolve_dispatch(reg, None, "cuda", capability=(9, 0))
    assert sm90.chosen("fp4_linear") == "triton_fp4_linear" and sm90.chosen("fp4_fused_moe") == "triton_fp4_fused_moe"
    assert resolve_dispatch(reg, None, "cpu").chosen("fp4_linear") == "torch_fp4_linear"
