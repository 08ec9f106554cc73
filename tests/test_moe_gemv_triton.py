"""The GEMV MoE path (armillary.kernels.triton.moe_gemv) against the float32 torch reference.

Runs under TRITON_INTERPRET=1 on CPU at tiny odd sizes (uneven K tiles, clamped N rows, partial
pair blocks); on a CUDA machine the same tests run compiled.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.moe import fused_moe as reference_moe  # noqa: E402
from armillary.kernels.triton import moe  # noqa: E402
from armillary.kernels.triton.moe import GEMV_DEFAULTS, fused_moe, gemv_config_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, H, I = 7, 3, 60, 36
# K tiles that do not divide H (60 % 16) or I (36 % 16), N tiles that do not divide I or H
TINY = [
    {"BLOCK_N1": 8, "BLOCK_K1": 16, "LOOP1": -1, "num_warps1": 2, "BLOCK_N2": 16, "BLOCK_K2": 16, "PAIR_BLOCK": 2,
     "LOOP2": 0, "num_warps2": 2},
    {"BLOCK_N1": 16, "BLOCK_K1": 32, "LOOP1": 2, "num_warps1": 4, "BLOCK_N2": 8, "BLOCK_K2": 32, "PAIR_BLOCK": 4,
     "LOOP2": 2, "num_warps2": 4},
    {"BLOCK_N1": 4, "BLOCK_K1": 64, "LOOP1": 0, "num_warps1": 1, "BLOCK_N2": 4, "BLOCK_K2": 64, "PAIR_BLOCK": 1,
     "LOOP2": -1, "num_warps2": 1, "pdl": True},  # one-shot K; pdl is a no-op off the GPU
]  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def make_moe(num_tokens: int, dtype: torch.dtype, gated: bool, shared: bool, seed: int = 0, hidden: int = H,
             inter: int = I, experts: int = E, top_k: int = K):
    """Random weights and routing; with ``shared`` the last expert is every token's last slot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    rows = 2 * inter if gated else inter
    w13 = torch.randn(experts, rows, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    routed = experts - 1 if shared else experts
    picks = top_k - 1 if shared else top_k
    ids = torch.stack([torch.randperm(routed, generator=g)[:picks] for _ in range(num_tokens)])
    if shared:
        ids = torch.cat((ids, torch.full((num_tokens, 1), experts - 1)), dim=1)
    weights = torch.rand(num_tokens, top_k, generator=g)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
def test_gemv_matches_reference(num_tokens, activation, dtype, shared):
    x, w13, w2, weights, ids = make_moe(num_tokens, dtype, activation == "silu", shared, seed=num_tokens)
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, activation)
    for i, cfg in enumerate(TINY):
        out = fused_moe(x, w13, w2, weights, ids.int() if i % 2 else ids, activation, path="gemv", config=cfg)
        assert out.dtype == dtype and out.shape == x.shape
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3), cfg


def test_gemv_default_config_even_sizes():
    """Dims that divide the (clamped) K tiles take the unmasked loads; no override uses the defaults."""
    x, w13, w2, weights, ids = make_moe(3, torch.float16, True, True, seed=7, hidden=64, inter=32, top_k=4)
    out = fused_moe(x, w13, w2, weights, ids, "silu", path="gemv")
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    assert rel_err(out, ref) < 5e-3


def test_gemv_reads_x_through_its_row_stride():
    """x given as a row-strided view (a slice of a wider buffer) is read through its row stride."""
    x, w13, w2, weights, ids = make_moe(2, torch.float32, True, False, seed=3)
    wide = torch.zeros(2, H + 8, device=DEVICE)
    wide[:, :H] = x
    out = fused_moe(wide[:, :H], w13, w2, weights, ids, "silu", path="gemv", config=TINY[0])
    ref = reference_moe(x, w13, w2, weights, ids, "silu")
    assert rel_err(out, ref) < 1e-5


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the GEMV path's launches; yields a setter for the tuning table fused_moe sees."""
    calls = []
    real = moe.moe_gemv

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "moe_gemv", spy)

    def set_table(table: dict) -> None:
        monkeypatch.setattr(tuning, "load_table", lambda package, target: table)

    yield calls, set_table


def test_auto_picks_gemv_up_to_max_tokens(gemv_calls):
    calls, set_table = gemv_calls
    set_table({"fused_moe_gemv": {"default": {"max_tokens": 2}, "t1": {"BLOCK_N1": 4}}})
    for num_tokens in (1, 2, 3):
        x, w13, w2, weights, ids = make_moe(num_tokens, torch.float32, True, True, seed=num_tokens)
        out = fused_moe(x, w13, w2, weights, ids, "silu")
        assert rel_err(out, reference_moe(x, w13, w2, weights, ids, "silu")) < 1e-5
    assert calls == [1, 2]  # T=3 took the decode kernels


def test_auto_without_table_entry_keeps_decode(gemv_calls):
    calls, set_table = gemv_calls
    set_table({})
    x, w13, w2, weights, ids = make_moe(1, torch.float32, True, True)
    fused_moe(x, w13, w2, weights, ids, "silu")
    assert calls == [] and GEMV_DEFAULTS["max_tokens"] == 0


def test_explicit_paths_stay_selectable(gemv_calls):
    calls, set_table = gemv_calls
    set_table({"fused_moe_gemv": {"default": {"max_tokens": 8}}})
    x, w13, w2, weights, ids = make_moe(2, torch.float32, False, True, seed=4)
    ref = reference_moe(x, w13, w2, weights, ids, "relu2")
    for path in ("decode", "grouped"):
        assert rel_err(fused_moe(x, w13, w2, weights, ids, "relu2", path=path), ref) < 1e-5
    assert calls == []
    with pytest.raises(ValueError, match="gemv"):
        fused_moe(x, w13, w2, weights, ids, "relu2", path="nope")


def test_gemv_config_key():
    assert [gemv_config_key(t) for t in (1, 2, 3, 4, 5, 8)] == ["t1", "t2", "t4", "t4", "t8", "t8"]


def test_sm90_table_entry_uses_known_keys():
    entry = tuning.load_table("armillary_qwen_gdn_moe", "sm_90")["fused_moe_gemv"]  # measured at Qwen's experts
    assert isinstance(entry["default"]["max_tokens"], int)
    for key, cfg in entry.items():
        if not key.startswith("_"):
            assert set(cfg) <= set(GEMV_DEFAULTS), key
