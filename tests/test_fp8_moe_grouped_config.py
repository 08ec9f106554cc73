"""The fp8 grouped (prefill) MoE under table-driven launch configs: today's tiles without a table, a table entry reaching the launch, non-default tiles against the reference, and bench/fp8_moe_grouped_sweep.py's smoke run with its --write and --merge."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from armillary.kernels import fp8 as ref
from armillary.kernels.triton import fp8_moe, fp8_moe_grouped, fp8_skinny
from tests.fixtures import grouped_sweeps

T, ROUTED, K, H, I = 20, 5, 2, 160, 96  # K routed slots + the shared expert (id ROUTED) last; 60 pairs, r16
KEY = "e6_h160_i96_k3_r16"
TODAY_GPU = {"variant": "grouped", "BLOCK_N1": 128, "num_warps1": 4, "num_stages1": 4, "GROUP_M1": 0,
             "BLOCK_N2": 128, "num_warps2": 4, "num_stages2": 4, "GROUP_M2": 0}  # fmt: skip
SPY_KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (root conftest)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _moe(block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = ref.quantize_blocks(torch.randn(ROUTED + 1, 2 * I, H, generator=g) * 0.1, *block)
    w2, s2 = ref.quantize_blocks(torch.randn(ROUTED + 1, H, I, generator=g) * 0.1, *block)
    x = torch.randn(T, H, generator=g)
    routed = torch.stack([torch.randperm(ROUTED, generator=g)[:K] for _ in range(T)])
    ids = torch.cat((routed, torch.full((T, 1), ROUTED)), dim=1).to(torch.int32)  # [T, K + 1]
    weights = torch.rand(T, K + 1, generator=g)
    x, w13, s13, w2, s2, weights, ids = (a.to(DEVICE) for a in (x, w13, s13, w2, s2, weights, ids))
    return x, w13, s13, w2, s2, *block, weights, ids


def test_defaults_are_todays_tiles(monkeypatch):
    assert fp8_moe.grouped_config_key(257, 2048, 512, 9, 64 * 9) == "e257_h2048_i512_k9_r4"
    assert fp8_moe.grouped_config_key(257, 2048, 512, 9, 2048 * 9) == "e257_h2048_i512_k9_r128"
    assert fp8_moe.grouped_config_key(257, 2048, 512, 9, 16384 * 9) == "e257_h2048_i512_k9_r512"  # 574: the last
    grouped_sweeps.set_table(monkeypatch, {})
    cpu = torch.device("cpu")
    assert fp8_moe.grouped_config(6, H, I, 3, 60, cpu) == {
        "variant": "grouped", "BLOCK_M": 16, "BLOCK_N1": 32, "num_warps1": 4, "num_stages1": 1, "GROUP_M1": 0,
        "BLOCK_N2": 32, "num_warps2": 4, "num_stages2": 1, "GROUP_M2": 0}  # fmt: skip
    monkeypatch.setattr(fp8_skinny, "OFFLINE_SM_COUNT", 132)  # GPU launch configs without a GPU
    assert fp8_moe.grouped_config(257, 2048, 512, 9, 576, cpu) == {"BLOCK_M": 16, **TODAY_GPU}
    # rows per tile by average rows per expert: 16 below 32, 32 below 64, then 64 (not by the pair count)
    assert fp8_moe.grouped_config(257, 2048, 512, 9, 1024, cpu) == {"BLOCK_M": 16, **TODAY_GPU}
    assert fp8_moe.grouped_config(257, 2048, 512, 9, 512 * 9, cpu) == {"BLOCK_M": 16, **TODAY_GPU}
    assert fp8_moe.grouped_config(257, 2048, 512, 9, 1024 * 9, cpu) == {"BLOCK_M": 32, **TODAY_GPU}
    assert fp8_moe.grouped_config(257, 2048, 512, 9, 2048 * 9, cpu) == {"BLOCK_M": 64, **TODAY_GPU}
    assert fp8_moe.grouped_block_m(1024, True) == 64  # without the expert count: the pair-count rule
    eight = {**TODAY_GPU, "num_warps1": 8, "num_warps2": 8}  # block_m=128: the 8-warp tiles, as before
    assert fp8_moe.grouped_defaults(147456, True, 128) == {"BLOCK_M": 128, **eight}


def test_table_entry_reaches_the_launch(monkeypatch):
    entry = {"BLOCK_M": 32, "BLOCK_N1": 64, "num_warps1": 2, "GROUP_M1": 3, "BLOCK_N2": 16, "num_stages2": 2}
    grouped_sweeps.set_table(monkeypatch, {"fp8_moe_grouped": {"_comment": "test", KEY: entry, "e6_h160_i96_k3_r8": {"BLOCK_M": 7}}})
    spy = grouped_sweeps.LaunchSpy(fp8_moe_grouped._grouped_kernel, SPY_KEYS)
    monkeypatch.setattr(fp8_moe_grouped, "_grouped_kernel", spy)  # where _grouped_gemm looks it up
    args = _moe((16, 32), seed=1)
    out = fp8_moe.fp8_fused_moe(*args, "silu", grouped=True)
    up, down = spy.launches
    base = fp8_moe.grouped_defaults(60, DEVICE.type == "cuda", 32)  # what the entry leaves unset
    assert {k: up[k] for k in ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")} == \
        {"BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 3, "num_warps": 2, "num_stages": base["num_stages1"]}
    assert {k: down[k] for k in ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")} == \
        {"BLOCK_M": 32, "BLOCK_N": 16, "GROUP_M": base["GROUP_M2"], "num_warps": base["num_warps2"], "num_stages": 2}
    assert len(up["grid"]) == 1 and len(down["grid"]) == 2  # the swizzle's 1-D grid; (blocks, N tiles) without
    assert down["grid"][1] == -(-H // 16) and up["grid"][0] == down["grid"][0] * -(-2 * I // 64)
    want = ref.fused_moe(*args, "silu", quantize_input=True)
    assert _ratio(out, want) < 1e-5
    spy.launches.clear()
    fp8_moe.fp8_fused_moe(*args, "silu", grouped=True, block_m=16)  # an explicit block_m: today's tiles, no table
    today = fp8_moe.grouped_defaults(60, DEVICE.type == "cuda", 16)
    assert [(la["BLOCK_M"], la["BLOCK_N"], la["GROUP_M"]) for la in spy.launches] == \
        [(16, today["BLOCK_N1"], today["GROUP_M1"]), (16, today["BLOCK_N2"], today["GROUP_M2"])]
    x, w13, s13, w2, s2, bn, bk, weights, ids = args
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two"):  # 12 tokens read r8: its bad value shows
        fp8_moe.fp8_fused_moe(x[:12], w13, s13, w2, s2, bn, bk, weights[:12], ids[:12], "silu", grouped=True)


def test_variant_dequant_takes_the_unpacked_experts(monkeypatch):
    """A bucket whose entry says "dequant" runs core's bf16 MoE on the unpacked experts, weight-only (grouped=True
    still forces the fp8 kernel); an unknown variant is named."""
    from armillary.kernels.triton import moe as bf16_moe

    grouped_sweeps.set_table(monkeypatch, {"fp8_moe_grouped": {KEY: {"variant": "dequant"}, "e6_h160_i96_k3_r8": {"variant": "x"}}})
    calls, spy = [], grouped_sweeps.LaunchSpy(fp8_moe_grouped._grouped_kernel, SPY_KEYS)
    real = bf16_moe.fused_moe
    monkeypatch.setattr(bf16_moe, "fused_moe", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    monkeypatch.setattr(fp8_moe_grouped, "_grouped_kernel", spy)  # where _grouped_gemm looks it up
    monkeypatch.setattr(fp8_moe, "GEMV_MAX_PAIRS", 8)  # 60 and 36 pairs: past the GEMV path
    args = _moe((16, 32), seed=2)
    out = fp8_moe.fp8_fused_moe(*args, "silu")
    assert calls == [(ROUTED + 1, 2 * I, H)] and not spy.launches  # the whole w13, unpacked
    assert _ratio(out, ref.fused_moe(*args, "silu")) < 1e-5  # activations unquantized
    fp8_moe.fp8_fused_moe(*args, "silu", grouped=True)
    assert len(calls) == 1 and len(spy.launches) == 2
    x, w13, s13, w2, s2, bn, bk, weights, ids = args
    with pytest.raises(ValueError, match="variant must be one of"):  # 12 tokens read r8
        fp8_moe.fp8_fused_moe(x[:12], w13, s13, w2, s2, bn, bk, weights[:12], ids[:12], "silu")


@pytest.mark.parametrize("block,tiles", [
    ((16, 32), {"BLOCK_M": 32, "BLOCK_N1": 16, "GROUP_M1": 2, "BLOCK_N2": 64, "GROUP_M2": 5}),
    ((128, 128), {"BLOCK_M": 16, "BLOCK_N1": 64, "num_stages1": 2, "BLOCK_N2": 256, "GROUP_M2": 1}),
])  # fmt: skip
def test_non_default_tiles_match_reference(block, tiles):
    """Tiles narrower and wider than the scale block (per-column scales past it), a swizzle over blocks that
    do not divide it, N tiles past I and H."""
    args = _moe(block, seed=len(tiles))
    out = fp8_moe.fp8_fused_moe(*args, "silu", grouped=True, tiles=tiles)
    assert _ratio(out, ref.fused_moe(*args, "silu", quantize_input=True)) < 1e-5


@pytest.mark.parametrize("tiles", [
    {"TMA1": 1, "TMA2": 1},
    {"BLOCK_M": 32, "BLOCK_N1": 64, "GROUP_M1": 2, "TMA1": 1, "BLOCK_N2": 32, "TMA2": 1},
    {"TMA1": 1, "TMA2": 0},
])  # fmt: skip
def test_tma_weight_tiles_match_reference(tiles):
    """Expert tiles through TMA descriptors (the interpreter emulates them on the CPU): N tiles past I and H
    read the next expert's rows, which only masked columns see; the last expert's past the end read zeros."""
    args = _moe((16, 32), seed=7)
    out = fp8_moe.fp8_fused_moe(*args, "silu", grouped=True, tiles=tiles)
    assert _ratio(out, ref.fused_moe(*args, "silu", quantize_input=True)) < 1e-5
    assert torch.equal(out, fp8_moe.fp8_fused_moe(*args, "silu", grouped=True, tiles={**tiles, "TMA1": 0, "TMA2": 0}))


def test_tma_rule_and_refusal():
    w = torch.empty(3, 256, 160, dtype=ref.FP8_DTYPE)
    assert not fp8_moe.use_tma(w, 32)  # off the GPU the rule says no
    assert fp8_moe.use_tma(w, 32, 1) and not fp8_moe.use_tma(w, 32, 0)
    with pytest.raises(ValueError, match="TMA needs"):
        fp8_moe.use_tma(w, 128, 1)  # 160 columns are not whole 128-column tiles
    with pytest.raises(ValueError, match="TMA needs"):
        fp8_moe.use_tma(w.transpose(1, 2), 32, 1)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    """One smoke run with --write into a copy of the Qwen plugin's sm_90 table; every bucket gets its best candidate."""
    out = tmp_path_factory.mktemp("fp8_moe_grouped_sweep")
    return out, grouped_sweeps.smoke_run("fp8_moe_grouped", out, timeout=300)


def test_smoke_sweep_checks_and_writes(smoke):
    out, result = smoke
    assert [r["key"] for r in result["results"]] == ["e6_h80_i48_k3_r2", "e6_h80_i48_k3_r16"]
    for r in result["results"]:  # the dequant path and the bf16 MoE against the weight-only reference
        assert set(r["context"]) == {"dequant", "bf16"} and all(c["err"] < 1e-2 for c in r["context"].values())
        assert r["variant"] == "grouped"  # the interpreter's dequant path is slower: never a slower path
    for r in result["results"]:  # the defaults timed once, as the base row: never again as a candidate
        assert r["rows"][0]["config"] == r["default"] and all(row["config"] != r["default"] for row in r["rows"][1:])
    rows = [row for r in result["results"] for row in r["rows"]]
    assert all(row["ok"] and row["err"] <= 1e-2 for row in rows), [row for row in rows if not row["ok"]]
    assert {row["config"]["BLOCK_M"] for row in rows} == {16, 32}
    assert {row["config"]["GROUP_M1"] for row in rows} == {0, 2}
    entry = grouped_sweeps.check_written(out, "fp8_moe_grouped", "fp8_moe_grouped")
    assert set(entry) == {"e6_h80_i48_k3_r2", "e6_h80_i48_k3_r16"}
    assert all(set(cfg) == set(fp8_moe.grouped_defaults(1, False)) and cfg != r["default"]
               for cfg, r in zip(entry.values(), result["results"]))


def test_merge_keeps_other_keys(smoke, tmp_path):
    grouped_sweeps.check_merge(smoke[0], "fp8_moe_grouped", "fp8_moe_grouped", tmp_path / "table.json")
