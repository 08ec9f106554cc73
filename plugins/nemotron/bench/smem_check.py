"""Shared memory of the nemotron plugin's Triton kernels, compiled offline for sm_90 / sm_121 (no GPU needed).

Calls the Mamba-2 kernel wrappers (SSD scan, serial and chunked; prefill gated norm; fused decode
step), the router's fp32 logits kernels and the group-limited top-k at the Nemotron-3-Nano bf16
shapes and the tiny fp32 test shapes under core's launch recorder (``bench/smem_check.py``: nothing runs,
the wrappers read the target's tuning tables), compiles each distinct launch through Triton's
passes up to shared-memory allocation and compares it with the target's limit. This also proves
the kernels compile for the GPU, which the CPU interpreter cannot show.

    python plugins/nemotron/bench/smem_check.py [--targets sm_90,sm_121] [--json out.json]

Exits 1 when a launch does not fit.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import smem_check as core_check  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton.moe_routing import topk_sigmoid_bias  # noqa: E402
from armillary_nemotron.ops.mamba.decode import mamba_decode_step  # noqa: E402
from armillary_nemotron.ops.mamba.gated_norm import gated_group_norm  # noqa: E402
from armillary_nemotron.ops.mamba.ssd_scan import ssd_chunk_scan  # noqa: E402
from armillary_nemotron.ops.router import router_logits  # noqa: E402

# name, dtype, heads, head_dim, groups, state, conv kernel
SHAPES = {
    "nano-bf16": [("nano", torch.bfloat16, 64, 64, 8, 128, 4)],
    "tiny-fp32": [("tiny-a", torch.float32, 4, 16, 2, 16, 4), ("tiny-b", torch.float32, 8, 8, 4, 16, 4),
                  ("tiny-c", torch.float32, 2, 32, 1, 16, 4)],
}


def _launch_mamba(dtype, heads, p, groups, n, kw, batch: int, tokens: int) -> None:
    d_inner, conv_dim = heads * p, heads * p + 2 * groups * n
    proj = torch.empty(tokens, d_inner + conv_dim + heads, dtype=dtype)
    z, xbc, dt = proj.split([d_inner, conv_dim, heads], dim=-1)
    conv_w, conv_b = torch.empty(conv_dim, kw, dtype=dtype), torch.empty(conv_dim, dtype=dtype)
    conv_states = torch.empty(batch + 1, conv_dim, kw - 1, dtype=dtype)
    ssm_states = torch.empty(batch + 1, heads, p, n, dtype=torch.float32)
    A, D, dt_bias = (torch.empty(heads, dtype=torch.float32) for _ in range(3))
    slots = torch.arange(batch, dtype=torch.int64)
    if tokens == batch:  # a decode-only step: both launch shapes (group walk, row split), whatever the table picks
        for split in (0, 16):
            mamba_decode_step(xbc, z, dt, conv_w, conv_b, conv_states, A, D, dt_bias, 1e-3,
                              torch.empty(d_inner, dtype=dtype), 1e-5, ssm_states, slots, heads, p,
                              config={"split_p": split})
    x, B, C = xbc.split([d_inner, groups * n, groups * n], dim=-1)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    ssd_chunk_scan(x, B, C, dt, A, D, dt_bias, 1e-3, cu, ssm_states, slots, heads, p)
    if tokens > batch:  # the prefill's gated norm, z read in place
        gated_group_norm(x, z, torch.empty(d_inner, dtype=dtype), 1e-5, d_inner // groups)


def _launch_router(experts: int, top_k: int, tokens: int, hidden: int, dtype: torch.dtype) -> None:
    """The fp32 logits (FMA rows in the model dtype, the three-term bf16 kernel at 64 and 16K rows), then the
    sigmoid top-k: one group (Nano) and grouped (n_group 8, best 4: DeepSeek-style configs)."""
    weight = torch.empty(experts, hidden)
    for rows in (1, 4, 8):
        router_logits(torch.empty(rows, hidden, dtype=dtype), weight)
    for rows in (64, 16384):
        router_logits(torch.empty(rows, hidden, dtype=torch.bfloat16), weight)
    logits, bias = torch.empty(tokens, experts), torch.empty(experts)
    topk_sigmoid_bias(logits, bias, top_k, True, 2.5, 2)
    topk_sigmoid_bias(logits, bias, top_k, True, 2.5, 2, n_group=8, topk_group=4)


def check(targets: list[str], exact: bool = False) -> list[dict]:
    jobs: dict[str, core_check.CompileJob] = {}
    for name in targets:
        target = core_check.TARGETS[name]
        for shapes, models in SHAPES.items():
            with core_check.recording(target) as (launches, where):
                tuning.use_packages(("armillary_nemotron",))
                for model, dtype, heads, p, groups, n, kw in models:
                    for batch, tokens in ((1, 1), (64, 64), (1, 16384), (4, 512)):
                        where[0] = f"{model}: batch {batch}, {tokens} tokens"
                        _launch_mamba(dtype, heads, p, groups, n, kw, batch, tokens)
                where[0] = f"{shapes}: router"
                nano = shapes == "nano-bf16"
                _launch_router(128 if nano else 16, 6 if nano else 2, 64, 2688 if nano else 64, models[0][1])
            core_check.compile_jobs(launches, target, shapes, jobs)
    job_list = list(jobs.values())
    sizes = core_check.measure(job_list, workers=1, exact=exact)
    rows = []
    for job, shared in zip(job_list, sizes):
        for shapes, where in job.uses.items():
            rows.append(dict(target=job.target.name, limit=job.target.smem_limit, shapes=shapes,
                             kernel=job.kernel.fn.__name__, shared=shared, fits=shared <= job.target.smem_limit,
                             num_warps=job.options["num_warps"], num_stages=job.options["num_stages"],
                             constexprs={}, dtypes=[], where=where))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="sm_90,sm_121")
    ap.add_argument("--json", default=None, help="write the rows as JSON here ('-' for stdout)")
    ap.add_argument("--exact", action="store_true", help="compile through LLVM (slower; what the driver gets)")
    args = ap.parse_args()
    rows = check(args.targets.split(","), args.exact)
    if args.json == "-":
        print(json.dumps(rows))
    else:
        print(core_check.report(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
