"""The plugin models' batch-1..8 decode GEMM and GEMV-MoE launches, as their sm_90 tables configure them, compiled offline (no GPU).

For each model (decode_shapes.py: the bench configs' shapes) the skinny GEMM of every projection at
M = 1, 2, 4, 8 and ``fused_moe`` at T = 1, 2, 4, 8 are called under bench/smem_check.py's recorder
with the plugin's table overlaid (so the launches are those of an H100 / H200 at those sizes), each
distinct launch is compiled for sm_90 up to shared-memory allocation and checked against the SM's
limit. A config that does not compile or does not fit is what a GPU sweep would otherwise trip on.

    python bench/decode_tables_check.py [--model nemotron|glm|gemma4|gemma3|all] [--json out.json | -]

Exits 1 when a launch fails to compile or does not fit.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_shapes  # noqa: E402
import smem_check as core_check  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import moe, skinny_gemm  # noqa: E402

ROWS = (1, 2, 4, 8)


def _launch(model: str) -> None:
    """Every decode launch of the model's projections and experts (recorded, not run)."""
    for (n, k), names in decode_shapes.linear_shapes(model).items():
        weight = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in ROWS:
            cfg = skinny_gemm.lookup_config(rows, n, k)
            if cfg["use"] or names != ["lm_head"]:  # the heads the table leaves to cuBLAS are not launched
                skinny_gemm.skinny_gemm(torch.empty(rows, k, dtype=torch.bfloat16), weight)
    for s in decode_shapes.moe_shapes(model):
        w13 = torch.empty(s.experts, (2 if s.gated else 1) * s.inter, s.hidden, dtype=torch.bfloat16)
        w2 = torch.empty(s.experts, s.hidden, s.inter, dtype=torch.bfloat16)
        for tokens in ROWS:
            ids = torch.stack([torch.randperm(s.experts)[: s.pairs] for _ in range(tokens)]).to(torch.int32)
            moe.fused_moe(torch.empty(tokens, s.hidden, dtype=torch.bfloat16), w13, w2,
                          torch.rand(tokens, s.pairs), ids, s.activation)


def check(models: list[str], workers: int) -> list[dict]:
    target = core_check.TARGETS["sm_90"]
    rows = []
    for model in models:
        with core_check.recording(target) as (launches, _):
            tuning.use_packages((decode_shapes.PACKAGES[model],))
            _launch(model)
        jobs: dict[str, core_check.CompileJob] = {}
        core_check.compile_jobs(launches, target, model, jobs)
        ordered = list(jobs.values())
        try:
            shared = core_check.measure(ordered, workers)
        except Exception as e:  # name the model; the compile error says which kernel
            rows.append(dict(model=model, kernel="?", error=f"{type(e).__name__}: {str(e)[:300]}", fits=False))
            continue
        for job, nbytes in zip(ordered, shared):
            shown = {k: v for k, v in job.constexprs.items() if isinstance(k, str) and k.isupper()} \
                if isinstance(job.constexprs, dict) else {}
            rows.append(dict(model=model, kernel=job.kernel.fn.__name__, shared=nbytes, limit=target.smem_limit,
                             fits=nbytes <= target.smem_limit, num_warps=job.options.get("num_warps"),
                             constexprs={str(k): v for k, v in shown.items()}))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="all", choices=(*decode_shapes.MODELS[1:], "all"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows as JSON here ('-': only the JSON, to stdout)")
    args = ap.parse_args()
    models = list(decode_shapes.MODELS[1:]) if args.model == "all" else [args.model]
    rows = check(models, args.workers)
    if args.json == "-":
        print(json.dumps(rows))
        return 0 if all(r["fits"] for r in rows) else 1
    for r in rows:
        verdict = "ok" if r["fits"] else "FAIL " + r.get("error", f"{r.get('shared')} > {r.get('limit')} bytes")
        print(f"{r['model']:9} {r['kernel']:24} warps {r.get('num_warps')} shared {r.get('shared')}: {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
