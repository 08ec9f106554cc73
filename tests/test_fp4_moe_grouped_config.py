"""The NVFP4 grouped (prefill) MoE under table-driven launch configs: today's tiles without a table, a table entry reaching the launch, non-default tiles against the reference, bad tiles named, and bench/fp4_moe_grouped_sweep.py's smoke run with its --write and --merge."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from armillary.kernels import fp4 as ref
from armillary.kernels.triton import fp4_moe, fp8_skinny
from tests.fixtures import grouped_sweeps

T, ROUTED, K, H, I = 20, 5, 2, 160, 96  # K routed slots + the shared expert (id ROUTED) last; 60 pairs, r16
KEY = "e6_h160_i96_k3_r16"
LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (root conftest)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _moe(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(ROUTED + 1, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(ROUTED + 1, H, I, generator=g) * 0.1
    p13, s13, g13 = ref.quantize_nvfp4(w13)
    p2, s2, g2 = ref.quantize_nvfp4(w2)
    x = torch.randn(T, H, generator=g)
    routed = torch.stack([torch.randperm(ROUTED, generator=g)[:K] for _ in range(T)])
    ids = torch.cat((routed, torch.full((T, 1), ROUTED)), dim=1).to(torch.int32)  # [T, K + 1]
    weights = torch.rand(T, K + 1, generator=g)
    args = (x, p13, s13, ref.row_global_scale(g13, 2 * I), p2, s2, ref.row_global_scale(g2, H), weights, ids)
    return tuple(a.to(DEVICE) for a in args)


def test_defaults_are_todays_tiles(monkeypatch):
    assert fp4_moe.grouped_config_key(257, 2048, 512, 9, 2048 * 9) == "e257_h2048_i512_k9_r128"
    grouped_sweeps.set_table(monkeypatch, {})
    cpu = torch.device("cpu")
    interp = {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    assert fp4_moe.grouped_config(6, H, I, 3, 60, cpu) == {
        "variant": "grouped", "BLOCK_M": 16, **{f"{k}{g}": v for g in (1, 2) for k, v in interp.items()}}
    monkeypatch.setattr(fp8_skinny, "OFFLINE_SM_COUNT", 132)  # GPU launch configs without a GPU

    def gpu(bm: int, warps: int) -> dict:
        tile = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": warps, "num_stages": 3}
        return {"variant": "grouped", "BLOCK_M": bm, **{f"{k}{g}": v for g in (1, 2) for k, v in tile.items()}}

    assert fp4_moe.grouped_config(257, 2048, 512, 9, 576, cpu) == gpu(16, 4)  # before the table: these tiles
    assert fp4_moe.grouped_config(257, 2048, 512, 9, 1024, cpu) == gpu(64, 8)
    assert fp4_moe.grouped_defaults(147456, True, 128) == gpu(128, 8)


def test_table_entry_reaches_the_launch(monkeypatch):
    entry = {"BLOCK_M": 32, "BLOCK_N1": 64, "BLOCK_K1": 64, "num_warps1": 2, "BLOCK_N2": 16, "num_stages2": 2}
    grouped_sweeps.set_table(monkeypatch, {"fp4_moe_grouped": {"_comment": "test", KEY: entry, "e6_h160_i96_k3_r8": {"BLOCK_K1": 48}}})
    spy = grouped_sweeps.LaunchSpy(fp4_moe._grouped_kernel, LAUNCH_KEYS)
    monkeypatch.setattr(fp4_moe, "_grouped_kernel", spy)
    args = _moe(seed=1)
    out = fp4_moe.fp4_fused_moe(*args, "silu", grouped=True)
    up, down = spy.launches
    base = fp4_moe.grouped_defaults(60, DEVICE.type == "cuda", 32)  # what the entry leaves unset

    def want(gemm: int, **keys) -> dict:
        return {"BLOCK_M": 32, **{k: base[f"{k}{gemm}"] for k in LAUNCH_KEYS[1:]}, **keys}

    assert {k: up[k] for k in LAUNCH_KEYS} == want(1, BLOCK_N=64, BLOCK_K=64, num_warps=2)
    assert {k: down[k] for k in LAUNCH_KEYS} == want(2, BLOCK_N=16, num_stages=2)
    assert up["grid"][1] == -(-2 * I // 64) and down["grid"][1] == -(-H // 16)
    assert _ratio(out, ref.fused_moe(*args, "silu")) < 1e-5
    x, p13, s13, g13, p2, s2, g2, weights, ids = args
    with pytest.raises(ValueError, match="'BLOCK_K': 48"):  # 12 tokens read r8: its bad BLOCK_K shows
        fp4_moe.fp4_fused_moe(x[:12], p13, s13, g13, p2, s2, g2, weights[:12], ids[:12], "silu", grouped=True)


def test_variant_dequant_takes_the_unpacked_experts(monkeypatch):
    """A bucket whose entry says "dequant" runs core's bf16 MoE on the unpacked experts (grouped=True still forces
    the kernel); another bucket keeps the grouped kernel; an unknown variant is named."""
    from armillary.kernels.triton import moe as bf16_moe

    grouped_sweeps.set_table(monkeypatch, {"fp4_moe_grouped": {KEY: {"variant": "dequant"}, "e6_h160_i96_k3_r8": {"variant": "x"}}})
    calls, spy = [], grouped_sweeps.LaunchSpy(fp4_moe._grouped_kernel, LAUNCH_KEYS)
    real = bf16_moe.fused_moe
    monkeypatch.setattr(bf16_moe, "fused_moe", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    monkeypatch.setattr(fp4_moe, "_grouped_kernel", spy)
    monkeypatch.setattr(fp4_moe, "GEMV_MAX_PAIRS", 8)  # 60 and 36 pairs: past the GEMV path
    args = _moe(seed=2)
    out = fp4_moe.fp4_fused_moe(*args, "silu")
    assert calls == [(ROUTED + 1, 2 * I, H)] and not spy.launches  # the whole w13, unpacked
    assert _ratio(out, ref.fused_moe(*args, "silu")) < 1e-5
    fp4_moe.fp4_fused_moe(*args, "silu", grouped=True)
    assert len(calls) == 1 and len(spy.launches) == 2
    x, p13, s13, g13, p2, s2, g2, weights, ids = args
    with pytest.raises(ValueError, match="variant must be one of"):  # 12 tokens read r8
        fp4_moe.fp4_fused_moe(x[:12], p13, s13, g13, p2, s2, g2, weights[:12], ids[:12], "silu")


@pytest.mark.parametrize("tiles", [
    {"BLOCK_M": 32, "BLOCK_N1": 16, "BLOCK_K1": 128, "BLOCK_N2": 256, "BLOCK_K2": 64},
    {"BLOCK_M": 64, "BLOCK_N1": 64, "BLOCK_K1": 256, "num_stages1": 2, "BLOCK_N2": 32, "BLOCK_K2": 128},
])  # fmt: skip
def test_non_default_tiles_match_reference(tiles):
    """K tiles past H and I (the masked tail), N tiles past 2I and H, more rows per block than an expert has."""
    args = _moe(seed=len(tiles))
    out = fp4_moe.fp4_fused_moe(*args, "silu", grouped=True, tiles=tiles)
    assert _ratio(out, ref.fused_moe(*args, "silu")) < 1e-5


def test_bad_tiles_are_named():
    args = _moe()
    with pytest.raises(ValueError, match="BLOCK_M 24"):
        fp4_moe.fp4_fused_moe(*args, "silu", grouped=True, tiles={"BLOCK_M": 24})
    with pytest.raises(ValueError, match="'BLOCK_N': 48"):
        fp4_moe.fp4_fused_moe(*args, "silu", grouped=True, tiles={"BLOCK_N2": 48})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    """One smoke run with --write into a copy of the Qwen plugin's sm_90 table; every bucket gets its best candidate."""
    out = tmp_path_factory.mktemp("fp4_moe_grouped_sweep")
    return out, grouped_sweeps.smoke_run("fp4_moe_grouped", out, timeout=600)


def test_smoke_sweep_checks_and_writes(smoke):
    out, result = smoke
    assert [r["key"] for r in result["results"]] == ["e6_h80_i48_k3_r2", "e6_h80_i48_k3_r16"]
    for r in result["results"]:
        assert r["reference_err"] < 1e-5, r  # the defaults against armillary.kernels.fp4.fused_moe
        assert set(r["context"]) == {"dequant", "bf16"} and all(c["err"] < 1e-2 for c in r["context"].values())
    for r in result["results"]:  # the defaults timed once, as the base row: never again as a candidate
        assert r["rows"][0]["config"] == r["default"] and all(row["config"] != r["default"] for row in r["rows"][1:])
    rows = [row for r in result["results"] for row in r["rows"]]
    assert all(row["ok"] and row["err"] <= 1e-2 for row in rows), [row for row in rows if not row["ok"]]
    assert {row["config"]["BLOCK_M"] for row in rows} == {16, 32}
    assert {row["config"]["BLOCK_K1"] for row in rows} == {32, 64}
    entry = grouped_sweeps.check_written(out, "fp4_moe_grouped", "fp4_moe_grouped")
    assert set(entry) == {"e6_h80_i48_k3_r2", "e6_h80_i48_k3_r16"}
    assert all(set(cfg) == set(fp4_moe.grouped_defaults(1, False)) and cfg != r["default"]
               for cfg, r in zip(entry.values(), result["results"]))


def test_merge_keeps_other_keys(smoke, tmp_path):
    grouped_sweeps.check_merge(smoke[0], "fp4_moe_grouped", "fp4_moe_grouped", tmp_path / "table.json")
