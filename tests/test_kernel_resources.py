"""Every Triton kernel of the GPU fast path fits in sm_90 shared memory at the shapes it runs.

bench/smem_check.py records the launches the kernel wrappers make for the tiny fp32 test models
(bench/gpu_checks.py's fast-path run) and for the real Qwen3.6 / Qwen3-Next bf16 shapes, without
running them, and compiles each distinct launch for sm_90 offline. It runs in a subprocess: the
suite's TRITON_INTERPRET turns kernels into interpreted functions, which cannot be compiled.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from armillary.kernels.triton import moe, paged_attention

ROOT = Path(__file__).resolve().parents[1]
SM90_SHARED = 232448
_ALL = {
    "_write_kv_kernel", "_paged_attention_kernel", "_combine_splits_kernel", "_rms_norm_kernel", "_rotary_kernel",
    "_qk_norm_rope_store_kernel",
    "_route_kernel", "_count_and_rank_kernel", "_scatter_kernel", "_grouped_gemm_kernel", "moe_decode_up_kernel",
    "moe_decode_down_kernel", "_sum_topk_kernel", "moe_gemv_up_kernel", "moe_gemv_down_kernel", "_causal_conv1d_varlen_kernel", "l2norm_qk_kernel",
    "chunk_intra_kernel", "chunk_state_kernel", "chunk_output_kernel", "_gdn_decode_kernel", "_gdn_verify_kernel",
    "_gates_kernel", "_skinny_gemm_kernel",
}  # fmt: skip
# the tiny models' 256-token contexts never split the key range, so no combine launch; their steps' few
# (token, expert) pairs all sort in one program (sm_90's moe_align cap), the real prefill steps' in two launches
_TWO_LAUNCH_SORT = {"_count_and_rank_kernel", "_scatter_kernel"}
EXPECTED_KERNELS = {"tiny-fp32": _ALL - {"_combine_splits_kernel"} - _TWO_LAUNCH_SORT | {"_align_one_program_kernel"},
                    "real-bf16": _ALL | {"_align_one_program_kernel"}}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "smem_check.py"), "--shapes", ",".join(EXPECTED_KERNELS),
         "--targets", "sm_90", "--workers", "2", "--json", "-"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-4000:]  # 1: some launch does not fit (checked below)
    return json.loads(proc.stdout)


def test_every_fast_path_kernel_was_compiled(rows):
    for shapes, kernels in EXPECTED_KERNELS.items():
        assert {r["kernel"] for r in rows if r["shapes"] == shapes} == kernels, shapes


def test_every_launch_fits_sm90_shared_memory(rows):
    assert rows and all(r["limit"] == SM90_SHARED and r["shared"] >= 0 for r in rows)
    over = [f"{r['kernel']}: {r['shared']} B, warps {r['num_warps']} stages {r['num_stages']} {r['constexprs']} "
            f"[{r['where']}]" for r in rows if r["shared"] > SM90_SHARED]
    assert not over, "\n".join(over)


def test_fp32_gated_moe_gemm_is_no_larger_than_bf16(rows):
    """The crash: the gated GEMM 1 at the bf16 tiles needed 245760 B in fp32; fp32 K tiles are halved."""
    def worst(shapes: str, dtype: str) -> int:
        return max(r["shared"] for r in rows if r["shapes"] == shapes and r["kernel"] == "_grouped_gemm_kernel"
                   and r["constexprs"]["GATED"] and f"*{dtype}" in r["dtypes"])

    assert worst("tiny-fp32", "fp32") <= worst("real-bf16", "bf16")


@pytest.mark.parametrize("fit,cfg,halved", [
    (moe.fit_element_size, moe.GROUPED_DEFAULTS, ("BLOCK_K1", "BLOCK_K2")),
    (moe.fit_element_size, moe.DECODE_DEFAULTS, ("BLOCK_K1", "BLOCK_K2")),
    (paged_attention.fit_element_size, paged_attention.PREFILL_DEFAULTS["d256"], ("BLOCK_M", "BLOCK_N")),
    (paged_attention.fit_element_size, paged_attention.DECODE_DEFAULTS["d256"], ("BLOCK_N",)),
])  # fmt: skip
def test_tables_keep_2_byte_configs_and_halve_4_byte_tiles(fit, cfg, halved):
    assert fit(cfg, 2) == cfg
    wide = fit(cfg, 4)
    assert {k: v for k, v in wide.items() if k not in halved} == {k: v for k, v in cfg.items() if k not in halved}
    assert all(wide[k] == max(16, cfg[k] // 2) for k in halved)
