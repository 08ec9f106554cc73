"""The fp8 Triton kernels compiled offline for sm_90 at the real model's sizes (bench/fp8_compile_check.py --quick): they compile, fit shared memory, and keep the properties their speed rests on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_fp8_skinny_kernel", "_quant_act_kernel", "_fp8_block_gemm_kernel", "_gemv_up_kernel",
           "_gemv_down_kernel", "_grouped_kernel", "_write_kv_kernel", "_align_one_program_kernel"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fp8") / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_compile_check.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_fp8_kernel_compiles_and_fits(rows):
    assert KERNELS <= {r["kernel"] for r in rows}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


def test_decode_kernels_stream_16_byte_loads(rows):
    """The one-row skinny GEMM and the MoE GEMV read fp8 weights in 16-byte vectors; the multi-row
    skinny path and the prefill GEMMs pipeline their tiles through shared memory (cp.async)."""
    for r in rows:
        if r["kernel"] in ("_gemv_up_kernel", "_gemv_down_kernel") or (
                r["kernel"] == "_fp8_skinny_kernel" and r["constexprs"].get("USE_DOT") is False):
            assert r["wide_loads"] >= 4, r
        if r["kernel"] in ("_fp8_block_gemm_kernel", "_grouped_kernel") or r["constexprs"].get("USE_DOT") is True:
            assert r["cp_async"] > 0 and r["mma"] > 0, r


def test_prefill_gemms_use_fp8_wgmma_and_exact_kernels_round_as_torch(rows):
    big = [r for r in rows if r["kernel"] == "_fp8_block_gemm_kernel" and r["num_warps"] == 8]
    assert big and all(r["wgmma_e4m3"] > 0 for r in big)
    for r in rows:
        if r["kernel"] in ("_write_kv_kernel", "_quant_act_kernel"):
            assert r["approx_div"] == 0 and r["sign_flips"] == 0, r
    grouped = [r for r in rows if r["kernel"] == "_grouped_kernel"]
    assert {r["constexprs"]["BLOCK_M"] for r in grouped} >= {16, 128}
    assert all(r["wgmma_e4m3"] > 0 for r in grouped if r["num_warps"] == 8)


def test_skinny_gemm_asks_l2_for_its_weights_before_waiting(rows):
    """With PDL the fp8 decode GEMM prefetches its weight tile (the check compiles ``PREFETCH`` on), and the MoE
    up GEMV of one token its experts' up and down weights (bulk)."""
    skinny = [r for r in rows if r["kernel"] == "_fp8_skinny_kernel"]
    assert skinny and all(r["l2_prefetch"] > 0 and r["constexprs"].get("PREFETCH") is True for r in skinny), skinny
    up = [r for r in rows if r["kernel"] == "_gemv_up_kernel" and r["where"].endswith("T=1")]
    assert up and all(r["l2_prefetch"] >= 2 and r["constexprs"]["PREFETCH_EXPERTS"] is True for r in up), up


def test_one_program_alignment_orders_its_phases_with_barriers(rows):
    """The one-launch moe_align: its four phases a barrier apart (bar.sync), ranks from global atomics."""
    align = [r for r in rows if r["kernel"] == "_align_one_program_kernel"]
    assert align and all(r["barriers"] >= 3 and r["atomics"] >= 1 for r in align), align
