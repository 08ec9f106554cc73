"""The NVFP4 Triton kernels compiled offline (bench/nvfp4_compile_check.py --quick): Hopper kernels for sm_90, the native FP4 scaled-dot GEMM for sm_100 and sm_120; they compile, fit shared memory, keep subnormals, and use the instructions their speed rests on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOPPER = {"_fp4_skinny_kernel", "_dequant_kernel", "_fp4_bf16_gemm_kernel", "_fp4_fp8_gemm_kernel", "_quant_act_kernel",
          "_gemv_up_kernel", "_gemv_down_kernel", "_grouped_kernel"}
BLACKWELL = {"_fp4_skinny_kernel", "_quant_nvfp4_kernel", "_fp4_scaled_gemm_kernel", "_gemv_up_kernel",
             "_gemv_down_kernel", "_grouped_kernel"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("nvfp4") / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nvfp4_compile_check.py"), "--quick", "--targets",
                           "sm_90,sm_100,sm_120", "--json", str(out)], capture_output=True, text=True, timeout=1200)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_nvfp4_kernel_compiles_and_fits_each_target(rows):
    by_target = {t: {r["kernel"] for r in rows if r["target"] == t} for t in ("sm_90", "sm_100", "sm_120")}
    assert HOPPER <= by_target["sm_90"]
    assert BLACKWELL <= by_target["sm_100"] and BLACKWELL <= by_target["sm_120"]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


def test_no_flush_to_zero_in_the_unpacking_kernels(rows):
    """e2m1 0.5 decodes through the fp32 subnormal 2^-127: an ``.ftz`` multiply would zero every such weight."""
    assert all(r["ftz"] == 0 for r in rows), [r for r in rows if r["ftz"]]


def test_decode_streams_16_byte_loads_and_tiles_use_the_tensor_cores(rows):
    for r in rows:
        if r["kernel"] in ("_gemv_up_kernel", "_gemv_down_kernel") or (
                r["kernel"] == "_fp4_skinny_kernel" and r["constexprs"].get("USE_DOT") is False):
            assert r["wide_loads"] >= 4, r
        if r["kernel"] in ("_fp4_bf16_gemm_kernel", "_fp4_fp8_gemm_kernel", "_grouped_kernel",
                           "_fp4_scaled_gemm_kernel") or r["constexprs"].get("USE_DOT") is True:
            assert r["mma"] > 0 and r["cp_async"] > 0, r
    assert all(r["wgmma_e4m3"] > 0 for r in rows if r["kernel"] == "_fp4_fp8_gemm_kernel")


def test_blackwell_gemm_is_the_native_block_scaled_fp4_mma(rows):
    """tcgen05.mma kind::mxf4nvf4 on sm_100, mma.sync kind::mxf4nvf4 (e2m1 x e2m1, ue4m3 scales) on sm_120."""
    gemms = [r for r in rows if r["kernel"] == "_fp4_scaled_gemm_kernel"]
    assert {r["target"] for r in gemms} == {"sm_100", "sm_120"}
    assert all(r["fp4_mma"] > 0 and r["constexprs"].get("NATIVE") is True for r in gemms), gemms


def test_skinny_gemv_asks_l2_for_its_weights_before_waiting(rows):
    """With PDL the one-row and multi-row fp4 GEMVs prefetch their weight and scale tiles (the check compiles
    ``PREFETCH`` on), and the MoE up GEMV of one token its experts' up and down weights (bulk)."""
    skinny = [r for r in rows if r["kernel"] == "_fp4_skinny_kernel"]
    assert skinny and all(r["l2_prefetch"] > 0 and r["constexprs"].get("PREFETCH") is True for r in skinny), skinny
    up = [r for r in rows if r["kernel"] == "_gemv_up_kernel" and r["where"].endswith("T=1")]  # and w2 for down
    assert up and all(r["l2_prefetch"] >= 2 and r["constexprs"]["PREFETCH_EXPERTS"] is True for r in up), up
