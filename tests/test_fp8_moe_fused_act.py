"""The fp8 grouped MoE's up GEMM with the activation quantized in its epilogue: bit-equal to the two launches it replaces, the whole MoE with FUSE_ACT1 on and off, and the shapes that keep the two launches."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import fp8 as ref
from armillary.kernels.triton import fp8_moe, fp8_moe_grouped
from armillary.kernels.triton.fp8_gemm import act_group, quantize_act
from armillary.kernels.triton.moe_align import moe_align
from tests.fixtures import grouped_sweeps

E = 5
FUSED_KEYS = ("BLOCK_M", "G", "GROUP_M", "num_warps", "num_stages")


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _experts(hidden: int, inter: int, block: tuple[int, int], seed: int, gated: bool = True):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = ref.quantize_blocks(torch.randn(E, (2 if gated else 1) * inter, hidden, generator=g) * 0.1, *block)
    w2, s2 = ref.quantize_blocks(torch.randn(E, hidden, inter, generator=g) * 0.1, *block)
    return w13, s13, w2, s2


def _route(tokens: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    return x, torch.rand(tokens, top_k, generator=g), ids


def _both_ways(x, ids, w13, s13, block, activation: str, tile: dict, block_m: int = 16):
    """(hq, hs) of the fused up GEMM and of the up GEMM then the quantization launch, under the same tiles."""
    tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    align = moe_align(ids, E, block_m)
    xq, xs = quantize_act(x, act_group(x.shape[1], block[1]))
    code = fp8_moe._FUSED_ACTS[activation]
    h = fp8_moe_grouped._grouped_gemm(xq, xs, w13, s13, *block, top_k, tokens * top_k, align, x.dtype, tile)
    want = quantize_act(h, act_group(inter, block[1]), activation=code, gated=True)
    got = fp8_moe_grouped.grouped_act_gemm(xq, xs, w13, s13, *block, top_k, tokens * top_k, align, x.dtype, code,
                                           tile)
    return got, want


def _assert_bit_equal(got, want):
    (q, s), (want_q, want_s) = got, want
    assert q.shape == want_q.shape and s.shape == want_s.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


TILE = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "GROUP_M": 0}  # the interpreter's defaults


@pytest.mark.parametrize("activation,dtype,tokens,top_k", [
    ("silu", torch.bfloat16, 33, 2), ("silu", torch.float16, 1, 3), ("silu", torch.float32, 7, 3),
    ("relu2", torch.bfloat16, 7, 3), ("relu2", torch.float16, 33, 2),
    ("gelu_pytorch_tanh", torch.bfloat16, 1, 2), ("gelu_pytorch_tanh", torch.float16, 7, 3),
])  # fmt: skip
def test_fused_up_gemm_is_bit_equal(activation, dtype, tokens, top_k):
    """hidden 256, inter 256 in 128-column blocks: two K steps, two quantization groups (two programs per block)."""
    w13, s13, _, _ = _experts(256, 256, (128, 128), seed=tokens)
    x, _, ids = _route(tokens, top_k, 256, dtype, seed=tokens + top_k)
    got, want = _both_ways(x, ids, w13, s13, (128, 128), activation, TILE)
    assert got[0].shape == (tokens * top_k, 256) and got[1].shape == (2, tokens * top_k)
    _assert_bit_equal(got, want)


@pytest.mark.parametrize("hidden,inter,block,tile", [
    (200, 96, (16, 32), {"BLOCK_N": 16}),  # K tiles past H; scale rows narrower than G: a scale per column
    (200, 96, (16, 32), {"BLOCK_N": 64, "GROUP_M": 3}),  # the unfused tiles span scale rows: their product order
    (256, 64, (64, 32), {"BLOCK_N": 128, "GROUP_M": 2, "TMA": 1}),  # one scale per tile, per-column order; TMA
])  # fmt: skip
def test_fused_up_gemm_follows_the_unfused_tiles(hidden, inter, block, tile):
    """fp32 x, where the order of dot · a_scale · w_scale shows in the scales: the fused GEMM multiplies as the
    unfused launch under the same tiles does; odd K, the GROUP_M swizzle, TMA weight tiles."""
    w13, s13, _, _ = _experts(hidden, inter, block, seed=inter)
    x, _, ids = _route(9, 3, hidden, torch.float32, seed=hidden)
    _assert_bit_equal(*_both_ways(x, ids, w13, s13, block, "silu", {**TILE, **tile}))


@pytest.mark.parametrize("activation,dtype,tokens", [("silu", torch.float32, 33), ("gelu_pytorch_tanh",
                                                                                    torch.bfloat16, 7)])
def test_whole_moe_with_and_without_the_fused_up_gemm(monkeypatch, activation, dtype, tokens):
    """fp8_fused_moe's output is the same with FUSE_ACT1 on and off (the default), and the reference's."""
    grouped_sweeps.set_table(monkeypatch, {})
    fused = grouped_sweeps.LaunchSpy(fp8_moe_grouped._grouped_act_kernel, FUSED_KEYS)
    monkeypatch.setattr(fp8_moe_grouped, "_grouped_act_kernel", fused)
    w13, s13, w2, s2 = _experts(256, 256, (128, 128), seed=5)
    x, weights, ids = _route(tokens, 3, 256, dtype, seed=6)
    args = (x, w13, s13, w2, s2, 128, 128, weights, ids, activation)
    out = fp8_moe.fp8_fused_moe(*args, grouped=True, tiles={"FUSE_ACT1": 1})
    assert [(la["G"], la["BLOCK_M"]) for la in fused.launches] == [(128, 16)]
    assert torch.equal(out, fp8_moe.fp8_fused_moe(*args, grouped=True))
    assert len(fused.launches) == 1  # off: the two launches
    want = ref.fused_moe(*args, quantize_input=True)  # bf16: the interpreter truncates its stores, torch rounds
    assert out.dtype == dtype and _ratio(out, want) < (1e-5 if dtype == torch.float32 else 4e-2)


@pytest.mark.parametrize("activation,inter,gated,block", [
    ("gelu", 64, True, (16, 32)),  # an activation the epilogue does not have
    ("silu", 96, True, (128, 128)),  # I not whole 128-column groups
    ("relu2", 64, False, (16, 32)),  # plain experts: no gate
])  # fmt: skip
def test_unfused_shapes_keep_the_two_launches(monkeypatch, activation, inter, gated, block):
    fused = grouped_sweeps.LaunchSpy(fp8_moe_grouped._grouped_act_kernel, FUSED_KEYS)
    monkeypatch.setattr(fp8_moe_grouped, "_grouped_act_kernel", fused)
    w13, s13, w2, s2 = _experts(128, inter, block, seed=inter, gated=gated)
    x, weights, ids = _route(7, 2, 128, torch.float32, seed=1)
    args = (x, w13, s13, w2, s2, *block, weights, ids, activation)
    out = fp8_moe.fp8_fused_moe(*args, grouped=True, tiles={"FUSE_ACT1": 1})
    assert not fused.launches
    assert _ratio(out, ref.fused_moe(*args, quantize_input=True)) < 1e-5


def test_fuses_act_rule():
    w13 = torch.empty(E, 512, 64, dtype=torch.float8_e4m3fn)
    on = {"FUSE_ACT1": 1}
    assert fp8_moe_grouped.fuses_act(w13, 256, 128, torch.bfloat16, on)
    assert not fp8_moe_grouped.fuses_act(w13, 256, 128, torch.bfloat16, {"FUSE_ACT1": 0})
    assert not fp8_moe_grouped.fuses_act(w13, 512, 128, torch.bfloat16, on)  # w13 of I rows: not gated
    assert not fp8_moe_grouped.fuses_act(w13, 256, 128, torch.float64, on)
    assert fp8_moe_grouped.fuses_act(w13[:, :320], 160, 32, torch.float16, on)  # G = 32: five groups
    assert not fp8_moe_grouped.fuses_act(w13[:, :320], 160, 128, torch.float16, on)  # G = 128 does not divide 160
