"""The fp8 prefill routes' choices, measured in one process: the split cuBLAS linear, TMA expert tiles, tile rows.

    python bench/fp8_prefill_paths.py [--rows 2048,4096,8192,16384] [--tokens 8,64,128,256,512,1024,2048,4096,16384]

At the Qwen3.6-35B-A3B shapes (random weights, 128 × 128 blocks; on the GPU only):

- ``fp8_linear`` at the GDN input projection (N 12352 = 96.5 blocks, K 2048): cuBLAS on the whole blocks with the
  last 64 rows on the Triton GEMM (``PARTIAL_MIN_ROWS`` forced down) against the Triton GEMM alone; and N 12288
  with a 64-row unquantized tail written in place against the concatenation it replaced; errors against the
  w8a8 reference.
- the grouped MoE (257 × 2048 × 512, k 9, the Qwen plugin's tables): whole calls with the expert tiles through
  TMA as the tables and rule pick them, forced off and forced on, and at 128 .. 512 tokens (no table entry) with
  16 / 32 / 64 rows per tile (today's default rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fp8_moe_grouped_sweep as sweep  # noqa: E402
from grouped_search import error_ratio, events_us, time_us  # noqa: E402

from armillary.kernels import fp8 as ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp8_gemm, fp8_moe, fp8_scaled_mm  # noqa: E402


def linear_rows(rows: list[int]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w, s = ref.quantize_blocks(torch.randn(12352, 2048, device="cuda", generator=g) * 0.02, 128, 128)
    tail = (torch.randn(64, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    out, keep = [], fp8_scaled_mm.PARTIAL_MIN_ROWS
    for m in rows:
        x = torch.randn(m, 2048, device="cuda", generator=g).bfloat16()
        fp8_scaled_mm.PARTIAL_MIN_ROWS = 0  # the split at every size here
        split = lambda: fp8_gemm.fp8_linear(x, w, s, 128, 128)  # noqa: E731
        row = {"rows": m, "split_err": error_ratio(split(), ref.linear_w8a8(x, w, s, 128, 128, None).float()),
               "split_us": round(events_us(split, 20), 1),
               "triton_us": round(events_us(lambda: fp8_gemm.fp8_linear(x, w, s, 128, 128, config={"scaled_mm": False}),
                                            20), 1)}
        fp8_scaled_mm.PARTIAL_MIN_ROWS = keep
        whole, whole_s = w[:12288], s[:96]
        want = torch.cat([ref.linear_w8a8(x, whole, whole_s, 128, 128, None), x @ tail.t()], 1)
        row["tail_err"] = error_ratio(fp8_gemm.fp8_linear(x, whole, whole_s, 128, 128, tail=tail), want.float())
        row["tail_us"] = round(events_us(lambda: fp8_gemm.fp8_linear(x, whole, whole_s, 128, 128, tail=tail), 20), 1)
        row["cat_tail_us"] = round(events_us(lambda: torch.cat([fp8_gemm.fp8_linear(x, whole, whole_s, 128, 128),
                                                                x @ tail.t()], 1), 20), 1)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def moe_rows(tokens: list[int]) -> list[dict]:
    ex = sweep.Experts(sweep.QWEN)
    weights = (ex.w13, ex.s13, ex.w2, ex.s2, 128, 128)
    out = []
    with tuning.overlay("armillary_qwen_gdn_moe"):
        for t in tokens:
            x, w, ids = ex.inputs(t)
            variants = {"table": {}, "tma_off": {"tiles": {"TMA1": 0, "TMA2": 0}},
                        "tma_on": {"tiles": {"TMA1": 1, "TMA2": 1}}}
            if 128 <= t <= 512:
                variants.update({f"block_m{bm}": {"block_m": bm} for bm in (16, 32, 64)})
            row, outs = {"tokens": t}, {}
            for _ in range(2):  # interleaved: the better of two runs of each
                for name, kw in variants.items():
                    us, outs[name] = time_us(lambda: fp8_moe.fp8_fused_moe(x, *weights, w, ids, "silu", **kw), t)
                    row[f"{name}_us"] = round(min(us, row.get(f"{name}_us", float("inf"))), 1)
            row["max_err"] = max(error_ratio(o, outs["table"].float()) for o in outs.values())
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,4096,8192,16384")
    ap.add_argument("--tokens", default="8,64,128,256,512,1024,2048,4096,16384")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(),
              "linear": linear_rows([int(r) for r in args.rows.split(",")]),
              "moe": moe_rows([int(t) for t in args.tokens.split(",")])}
    (args.out / "fp8_prefill_paths.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
