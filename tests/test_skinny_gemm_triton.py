"""Triton skinny GEMM (decode projections) against the naive fp32 product, and ops.linear's dispatch.

Runs under TRITON_INTERPRET=1 on CPU at odd sizes (fp32 / fp16: the interpreter miscomputes bf16);
on a CUDA machine the same tests run compiled.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels import ops, tuning  # noqa: E402

QWEN = "armillary_qwen_gdn_moe"  # the plugin whose table holds the measured (Qwen projection) shapes
from armillary.kernels.triton import skinny_gemm as sg  # noqa: E402
from armillary.kernels.triton.device_buffers import ticket_buffer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# small tiles so the odd sizes span several N tiles and K blocks
FMA = {"path": "fma", "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2}
DOT = {"path": "dot", "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def make(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def tickets_clear() -> bool:
    return not bool(ticket_buffer(torch.device(DEVICE), 0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 257, 60), (3, 67, 60), (8, 67, 200), (3, 257, 200), (1, 67, 2000)])
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_matches_fp32_reference(rows, n, k, dtype, cfg):
    x, w, b = make(rows, n, k, dtype, bias=rows != 8)
    out = sg.skinny_gemm(x, w, b, config={**cfg, "split_k": 1})
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, sg.skinny_reference(x, w, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k,split", [(1, 257, 2000, 5), (3, 67, 200, 2), (8, 67, 200, 4)])
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_split_k_is_deterministic_and_resets_tickets(rows, n, k, split, dtype, cfg):
    x, w, b = make(rows, n, k, dtype, bias=True)
    ref = sg.skinny_reference(x, w, b)
    launch = sg._launch_shape({**sg.DEFAULTS, **cfg, "split_k": split}, rows, n, k, x.element_size(), x.device)
    assert launch["split_k"] == split
    first = sg.skinny_gemm(x, w, b, config={**cfg, "split_k": split})
    assert rel_err(first, ref) < TOL[dtype]
    assert tickets_clear()
    for _ in range(2):  # the next calls start from zeroed tickets and sum in the same order
        assert torch.equal(sg.skinny_gemm(x, w, b, config={**cfg, "split_k": split}), first)
    assert tickets_clear()


def test_split_k_uneven_blocks_and_into_out():
    """K = 2000 over 64-wide blocks: 32 blocks, 6 splits of 6 blocks (the last short); a row-strided out."""
    x, w, b = make(3, 67, 2000, torch.float32, bias=True)
    out = torch.full((3, 80), 7.0, device=DEVICE)[:, 5:72]
    got = sg.skinny_gemm(x, w, b, out=out, config={**FMA, "split_k": 6})
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out, sg.skinny_reference(x, w, b)) < TOL[torch.float32]
    launch = sg._launch_shape({**sg.DEFAULTS, **FMA, "split_k": 6}, 3, 67, 2000, 4, x.device)
    assert launch["split_k"] == 6 and launch["BLOCK_K"] == 32  # fp32 tiles halve the 2-byte depth



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,split", [(257, 60, 1), (67, 2000, 1), (67, 2000, 3), (257, 256, 2)])
def test_preload_one_row_matches_the_reference(n, k, split, dtype):
    """``preload``: one K block a program (BLOCK_K widened to the split's range, a part block past K), its weight
    tile loaded before the PDL wait; same sums as the reference, split tickets back at zero."""
    x, w, b = make(1, n, k, dtype, bias=True)
    cfg = {**FMA, "split_k": split, "preload": True}
    launch = sg._launch_shape({**sg.DEFAULTS, **cfg}, 1, n, k, x.element_size(), x.device)
    assert launch["PRELOAD"] and launch["blocks_per_split"] == 1
    assert launch["BLOCK_K"] * launch["split_k"] >= k > launch["BLOCK_K"] * (launch["split_k"] - 1)
    assert rel_err(sg.skinny_gemm(x, w, b, config=cfg), sg.skinny_reference(x, w, b)) < TOL[dtype]
    assert tickets_clear()
    several = sg._launch_shape({**sg.DEFAULTS, **cfg}, 3, n, k, x.element_size(), x.device)
    assert not several["PRELOAD"]  # a few rows keep their loop

@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_row_strided_x_and_weight(cfg):
    """Column slices of wider matrices (x from a fused projection, W a block of a stacked weight)."""
    x, w, _ = make(4, 67, 120, torch.float32, bias=False)
    x_wide, w_wide = torch.zeros(4, 200, device=DEVICE), torch.zeros(67, 136, device=DEVICE)
    x_wide[:, 7:127], w_wide[:, 16:136] = x, w
    got = sg.skinny_gemm(x_wide[:, 7:127], w_wide[:, 16:136], config=cfg)
    assert rel_err(got, sg.skinny_reference(x, w)) < TOL[torch.float32]


def test_auto_split_fills_the_sms():
    cfg = {**sg.DEFAULTS, "BLOCK_N": 16, "BLOCK_K": 256, "target_waves": 2}
    launch = sg._launch_shape(cfg, 1, 2048, 4096, 2, torch.device("cpu"))
    assert launch["split_k"] == 1  # one "SM" on the CPU
    sg_count = sg._sm_count
    try:
        sg._sm_count = lambda device: 132
        launch = sg._launch_shape(cfg, 1, 2048, 4096, 2, torch.device("cpu"))
        assert launch["split_k"] == 2 and launch["tiles"] == 128  # 256 programs ~ 2 waves of 132
        assert sg._launch_shape(cfg, 1, 12352, 2048, 2, torch.device("cpu"))["split_k"] == 1
    finally:
        sg._sm_count = sg_count


def test_rejects_mismatched_layouts():
    x, w, _ = make(2, 16, 32, torch.float32, bias=False)
    with pytest.raises(ValueError):
        sg.skinny_gemm(x, w.t().contiguous().t())
    with pytest.raises(ValueError):
        sg.skinny_gemm(x, w, out=torch.empty(2, 17, device=DEVICE))


@pytest.fixture
def count_kernel_calls(monkeypatch):
    calls = []
    real = sg.skinny_gemm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(sg, "skinny_gemm", counted)
    return calls


def test_ops_linear_dispatch(count_kernel_calls):
    x, w, b = make(3, 67, 60, torch.float32, bias=True)
    ref = torch.nn.functional.linear(x, w, b)
    try:
        ops.set_backend("triton")
        assert rel_err(ops.linear(x, w, b), ref) < TOL[torch.float32]
        assert len(count_kernel_calls) == 1
        big = torch.randn(sg.DEFAULTS["max_rows"] + 1, 60, device=DEVICE)
        ops.linear(big, w, b)  # prefill-sized: torch
        ops.linear(x[None], w, b)  # not 2-D: torch
        assert len(count_kernel_calls) == 1
        assert sg.serves(x.half(), w, None, require_win=False) is None  # dtypes differ
        assert sg.serves(x, w, b.half(), require_win=False) is None
        ops.set_backend("reference")
        assert torch.equal(ops.linear(x, w, b), ref)
        if DEVICE == "cpu":
            ops.set_backend("auto")
            assert torch.equal(ops.linear(x, w, b), ref)  # the CPU reference path
        assert len(count_kernel_calls) == 1
    finally:
        ops.set_backend("auto")


def test_table_decides_under_auto(monkeypatch):
    """The sm_90 table marks shapes where the kernel beats cuBLAS; others stay on cuBLAS under "auto"."""
    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(tuning, "_overlay", (QWEN,))  # the shapes are the Qwen plugin's (ops.install sets it)
    table = tuning.load_table(QWEN, "sm_90")[sg.KERNEL]
    used = [key for key, entry in table.items() if isinstance(entry, dict) and entry.get("use")]
    if not used:
        pytest.skip("the sm_90 table marks no shape for the kernel")
    n, k, m = (int(part[1:]) for part in used[0].split("_"))
    x, w = torch.empty(m, k, dtype=torch.float16), torch.empty(n, k, dtype=torch.float16)
    assert sg.serves(x, w, None, require_win=True) is not None
    odd = torch.empty(n + 1, k, dtype=torch.float16)
    assert sg.serves(x, odd, None, require_win=True) is None
    assert sg.serves(x, odd, None, require_win=False) is not None
    max_rows = sg.lookup_config(m, n, k)["max_rows"]
    assert sg.serves(torch.empty(max_rows + 1, k, dtype=torch.float16), w, None, require_win=False) is None
