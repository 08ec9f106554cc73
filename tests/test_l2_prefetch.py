"""Weight prefetches before the PDL wait: the skinny GEMM compiled offline for sm_90 with the prefetches between
``launch_dependents`` and ``wait`` (the policy's tests are test_pdl_policy.py's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from armillary.kernels.triton.skinny_gemm import _skinny_gemm_kernel
ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
        "ticket_ptr": "*i32"}
ints = {k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "blocks_per_split", "split_k")}
consts = {"HAS_BIAS": False, "USE_DOT": False, "DOT_PRECISION": "tf32", "EVEN_K": True, "BLOCK_M": 1,
          "BLOCK_N": 8, "BLOCK_K": 256, "PDL": True, "PREFETCH": sys.argv[1] == "1"}
signature = {**ptrs, **ints, **{k: "constexpr" for k in consts}}
ptx = triton.compile(ASTSource(_skinny_gemm_kernel, signature, consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(json.dumps([m.group(0) for m in re.finditer(r"griddepcontrol\\.\\w+|prefetch\\.global\\.L2|ld\\.global", ptx)]))
"""


@pytest.mark.parametrize("prefetch", [True, False])
def test_skinny_gemm_prefetches_between_launch_and_wait_on_sm90(prefetch):
    """Compiled for sm_90 (ptxas included; a fresh interpreter, as the suite's kernels are interpreted): the
    prefetches come after ``launch_dependents`` and before ``wait``, the weight loads after it; none without
    PREFETCH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, "1" if prefetch else "0"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = json.loads(proc.stdout.strip().splitlines()[-1])
    first_wait = lines.index("griddepcontrol.wait")
    assert lines[0] == "griddepcontrol.launch_dependents" and "ld.global" in lines[first_wait:]
    assert "ld.global" not in lines[:first_wait]
    if prefetch:
        assert "prefetch.global.L2" in lines[1:first_wait] and "prefetch.global.L2" not in lines[first_wait:]
    else:
        assert "prefetch.global.L2" not in lines
