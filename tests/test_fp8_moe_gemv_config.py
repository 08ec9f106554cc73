"""The fp8 MoE decode GEMV under table-driven launch configs: non-default tiles at odd sizes against the fp32 dequantized reference, and the table's entry reaching the launch."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import fp8 as ref
from armillary.kernels import tuning
from armillary.kernels.triton import fp8_moe, fp8_skinny

T, ROUTED, K, H, I = 2, 5, 1, 160, 96  # K routed slots + the shared expert (id ROUTED) as the last slot
# up: BLOCK_N1 4 / 8 share one scale row per tile; 64 exceeds the 16-row scale block (per-row scales) and
# straddles I (clamped rows); widths under, equal to and over the K block / K; stages > 1: the pipelined loop
CONFIGS = {
    "bn4": {"BLOCK_N1": 4, "BLOCK_K1": 64, "num_warps1": 2, "num_stages1": 1, "BLOCK_N2": 16, "BLOCK_K2": 32,
            "num_warps2": 2},
    "bn8_wide": {"BLOCK_N1": 8, "BLOCK_K1": 256, "num_stages1": 2, "BLOCK_N2": 16, "BLOCK_K2": 128},
    "bn8_piped": {"BLOCK_N1": 8, "BLOCK_K1": 32, "num_stages1": 3, "BLOCK_N2": 32, "BLOCK_K2": 16},
    "bn64": {"BLOCK_N1": 64, "BLOCK_K1": 128, "num_warps1": 4, "BLOCK_N2": 32, "BLOCK_K2": 64, "num_warps2": 8},
}  # fmt: skip


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _moe(block: tuple[int, int | None], seed: int = 0, tokens: int = T):
    """x, fp8 experts (ROUTED routed + 1 shared) with block scales, Qwen's routing layout: distinct routed ids
    per token, then the shared expert; softmax weights, the shared one a sigmoid gate."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block[0], block[1] or max(H, I)
    w13, s13 = ref.quantize_blocks(torch.randn(ROUTED + 1, 2 * I, H, generator=g) * 0.1, bn, bk)
    w2, s2 = ref.quantize_blocks(torch.randn(ROUTED + 1, H, I, generator=g) * 0.1, bn, bk)
    x = torch.randn(tokens, H, generator=g)
    routed = torch.stack([torch.randperm(ROUTED, generator=g)[:K] for _ in range(tokens)])
    ids = torch.cat((routed, torch.full((tokens, 1), ROUTED)), dim=1).to(torch.int32)  # [T, K + 1]
    weights = torch.cat((torch.rand(tokens, K, generator=g).softmax(-1), torch.rand(tokens, 1, generator=g)), dim=1)
    return x, w13, s13, w2, s2, bn, bk, weights, ids


@pytest.mark.parametrize("name,block", [("bn4", (16, 32)), ("bn8_wide", (16, 32)), ("bn8_piped", (16, 32)),
                                        ("bn64", (16, 32)), ("bn4", (128, 128)), ("bn64", (128, 128)),
                                        ("bn8_wide", (1, None))])
def test_gemv_under_config_matches_reference(name, block):
    x, w13, s13, w2, s2, bn, bk, weights, ids = _moe(block, seed=len(name))
    out = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu", grouped=False,
                                gemv=CONFIGS[name])
    want = ref.fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu")
    assert _ratio(out, want) < 1e-5


def test_up_and_down_kernels_apart_match_reference():
    """gemv_up's h (the activation fused) and gemv_down's weighted sum, each against torch in fp32."""
    x, w13, s13, w2, s2, bn, bk, weights, ids = _moe((16, 32), seed=9)
    cfg = {**fp8_moe.INTERPRETER_DEFAULTS, **CONFIGS["bn8_wide"]}
    flat = ids.reshape(-1).long()
    w13f, w2f = ref.dequantize(w13, s13, bn, bk)[flat], ref.dequantize(w2, s2, bn, bk)[flat]  # [P, 2I, H], [P, H, I]
    gu = torch.bmm(w13f, x.repeat_interleave(ids.shape[1], dim=0)[:, :, None])[:, :, 0]  # [P, 2I]
    h_want = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    h = torch.full((flat.numel(), I), float("nan"))
    fp8_moe.gemv_up(x, w13, s13, bn, bk, ids, h, "silu", cfg)
    assert _ratio(h, h_want) < 1e-5
    out = torch.full((T, H), float("nan"))
    fp8_moe.gemv_down(h_want, w2, s2, bn, bk, ids, weights, out, cfg)
    y = torch.bmm(w2f, h_want[:, :, None])[:, :, 0] * weights.reshape(-1, 1)  # [P, H]
    assert _ratio(out, y.view(T, -1, H).sum(1)) < 1e-5


def test_table_entry_reaches_the_launch(monkeypatch):
    key = fp8_moe.gemv_config_key(ROUTED + 1, H, I, K + 1, 3)
    assert key == "e6_h160_i96_k2_t4" and fp8_moe.gemv_config_key(257, 2048, 512, 9, 1) == "e257_h2048_i512_k9_t1"
    def set_table(table: dict) -> None:  # a fresh function each time: kernel_config's memo keys on it
        monkeypatch.setattr(tuning, "load_table", lambda package, target: table)

    set_table({})
    cpu = torch.device("cpu")
    assert fp8_moe.gemv_config(ROUTED + 1, H, I, K + 1, 3, cpu) == fp8_moe.INTERPRETER_DEFAULTS
    monkeypatch.setattr(fp8_skinny, "OFFLINE_SM_COUNT", 132)  # GPU launch configs without a GPU
    assert fp8_moe.gemv_config(ROUTED + 1, H, I, K + 1, 3, cpu) == {  # today's picks, until a table says otherwise
        "BLOCK_N1": 2, "BLOCK_K1": 1024, "num_warps1": 2, "num_stages1": 1,
        "BLOCK_N2": 4, "BLOCK_K2": 512, "num_warps2": 4, "num_stages2": 1}  # fmt: skip
    monkeypatch.setattr(fp8_skinny, "OFFLINE_SM_COUNT", None)
    set_table({"fp8_moe_gemv": {"_comment": "test", key: CONFIGS["bn64"], "e6_h160_i96_k2_t2": {"BLOCK_N1": 3}}})
    assert fp8_moe.gemv_config(ROUTED + 1, H, I, K + 1, 3, cpu)["BLOCK_N1"] == 64  # T=3 reads t4, not t2
    x, w13, s13, w2, s2, bn, bk, weights, ids = _moe((16, 32), seed=3, tokens=3)
    want = ref.fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu")
    assert _ratio(fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu"), want) < 1e-5
    with pytest.raises(ValueError, match="powers of two"):  # t2's entry is launched, so its bad value shows
        fp8_moe.fp8_fused_moe(x[:2], w13, s13, w2, s2, bn, bk, weights[:2], ids[:2], "silu")


@pytest.mark.parametrize("block", [(16, 32), (128, 128), (1, None)])
@pytest.mark.parametrize("bn2,tokens", [(16, 1), (64, 3)])
def test_down_preload_over_pairs_matches_reference(monkeypatch, block, bn2, tokens):
    """``down_preload``: the down GEMV split over (token, expert) pairs (``fp8_moe_down``), summed in pair order by
    the last arriver; 64 rows straddle H (clamped); tickets back at zero; a BLOCK_K2 under I keeps the walk."""
    from armillary.kernels.triton import fp8_moe_down
    from armillary.kernels.triton.device_buffers import ticket_buffer

    calls = []
    inner = fp8_moe_down.gemv_down_pairs
    monkeypatch.setattr(fp8_moe, "gemv_down_pairs", lambda *a, **kw: calls.append(kw) or inner(*a, **kw))
    x, w13, s13, w2, s2, bn, bk, weights, ids = _moe(block, seed=bn2 + tokens, tokens=tokens)
    want = ref.fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu")
    cfg = {**CONFIGS["bn4"], "BLOCK_N2": bn2, "BLOCK_K2": 128, "down_preload": True}
    for _ in range(2):
        out = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu", grouped=False, gemv=cfg)
        assert _ratio(out, want) < 1e-5
    assert len(calls) == 2
    assert not ticket_buffer(torch.device("cpu"), 0).any()
    walk = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu", grouped=False,
                                 gemv={**cfg, "BLOCK_K2": 32})
    assert len(calls) == 2 and _ratio(walk, want) < 1e-5
