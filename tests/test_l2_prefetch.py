"""Weight prefetches before the PDL wait: the skinny GEMM compiled offline for sm_90 with the prefetches between
``launch_dependents`` and ``wait`` (the policy's tests are test_pdl_policy.py's)."""
from __future__ import annotations

import pytest

from armillary.testing.offline_ptx import assert_prefetch_before_wait, kernel_ptx

PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
        "ticket_ptr": "*i32"}
INTS = {k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "blocks_per_split", "split_k")}


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("use_dot", [False, True])
def test_skinny_gemm_prefetches_between_launch_and_wait_on_sm90(prefetch, use_dot):
    consts = {"HAS_BIAS": False, "USE_DOT": use_dot, "DOT_PRECISION": "tf32", "EVEN_K": True,
              "BLOCK_M": 16 if use_dot else 1, "BLOCK_N": 64 if use_dot else 8, "BLOCK_K": 128 if use_dot else 256,
              "PDL": True, "PREFETCH": prefetch, "PRELOAD": False}
    ptx = kernel_ptx("armillary.kernels.triton.skinny_gemm", "_skinny_gemm_kernel",
                     {**PTRS, **INTS, **{k: "constexpr" for k in consts}}, consts)
    assert_prefetch_before_wait(ptx, prefetch)
