"""Shared memory of the MLA decode kernel's launches at GLM-4.7-Flash's shape, compiled offline for sm_90.

Run as a script (``test_mla_kernels`` does, in a subprocess without TRITON_INTERPRET): records the
launches ``mla_decode`` makes for each config with bench/smem_check.py's recorder, compiles each
distinct one and prints ``[{"config": ..., "kernel": ..., "shared": bytes}]`` as JSON.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import smem_check  # noqa: E402

from armillary_glm_flash.ops.mla import decode  # noqa: E402

CONFIGS = [dict(decode.DEFAULTS),  # the shipped default, and the largest tile the sweep tries
           dict(decode.DEFAULTS, BLOCK_H=32, BLOCK_N=64, num_warps=8, num_stages=1)]


def main() -> None:
    launches: list = []
    JITFunction.run = lambda kernel, *args, grid, warmup, **kw: launches.append(
        smem_check.Launch(kernel, args, kw, json.dumps(CONFIGS[len(launches) // 2])))
    batch, heads, dl, dr = 4, 20, 512, 64
    kv = torch.zeros(10, 16, dl + dr, dtype=torch.bfloat16)
    tables, lens = torch.zeros(batch, 4, dtype=torch.int32), torch.ones(batch, dtype=torch.int32)
    q_lat = torch.zeros(batch, heads, dl, dtype=torch.bfloat16)
    q_pe = torch.zeros(batch, heads, dr, dtype=torch.bfloat16)
    for cfg in CONFIGS:
        decode.mla_decode(q_lat, q_pe, kv, tables, lens, 0.1, 4096, config=cfg, num_splits=4)  # split + combine
    target = smem_check.TARGETS["sm_90"]
    jobs: dict = {}
    smem_check.compile_jobs(launches, target, "real-bf16", jobs)
    rows = [{"config": job.uses["real-bf16"], "kernel": job.kernel.fn.__name__, "shared": smem_check.shared_bytes(job),
             "limit": target.smem_limit} for job in jobs.values()]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
