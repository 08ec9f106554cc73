"""The quantized grouped MoEs before and after a change to the work around their GEMMs, in one process.

    mkdir -p OLD && git show REV:core/kernels/triton/fp8_moe.py > OLD/fp8_moe.py \
        && git show REV:core/kernels/triton/fp4_moe.py > OLD/fp4_moe.py
    python bench/moe_epilogue_ab.py --old OLD [--fp8-tokens 1024,2048,4096,16384] [--fp4-tokens 128,1024]

Loads OLD's fp8_moe.py / fp4_moe.py beside today's modules (their imports resolve to today's package), then at
the Qwen3.6-35B-A3B expert shape (257 × 2048 × 512 with the shared expert, k 9, random weights; fp8 128 × 128
blocks, NVFP4 groups of 16) times each module's grouped path (``grouped=True``, the tiles of the Qwen plugin's
tables) and today's table-chosen path, side by side, with grouped_search's timer, and prints each output's error
against the old grouped output. On the GPU only.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from grouped_search import error_ratio, time_us  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp4_moe, fp8_moe  # noqa: E402


def load_old(folder: Path, name: str):
    """OLD/{name}.py as a module of its own (``old_{name}``)."""
    spec = importlib.util.spec_from_file_location(f"old_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(label: str, tokens: int, calls: dict) -> dict:
    """µs of each named call (the first is the baseline of the errors) and each output's error against it."""
    times, outs = {}, {}
    for _ in range(2):  # twice, interleaved: the better of two runs of each
        for name, fn in calls.items():
            us, outs[name] = time_us(fn, tokens)
            times[name] = min(us, times.get(name, float("inf")))
    base = next(iter(calls))
    row = {"kind": label, "tokens": tokens, **{f"{n}_us": round(t, 1) for n, t in times.items()},
           **{f"{n}_err": error_ratio(outs[n], outs[base].float()) for n in calls if n != base}}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="folder with the old fp8_moe.py and fp4_moe.py")
    ap.add_argument("--fp8-tokens", default="1024,2048,4096,16384")
    ap.add_argument("--fp4-tokens", default="128,1024")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    import fp8_moe_grouped_sweep as fp8_sweep  # noqa: E402  (GPU shapes: no --tiny)
    import fp4_moe_grouped_sweep as fp4_sweep  # noqa: E402

    old8, old4 = load_old(args.old, "fp8_moe"), load_old(args.old, "fp4_moe")
    rows = []
    with tuning.overlay("armillary_qwen_gdn_moe"), torch.inference_mode():
        e8 = fp8_sweep.Experts(fp8_sweep.QWEN)
        w8 = (e8.w13, e8.s13, e8.w2, e8.s2, *fp8_sweep.BLOCK)
        for t in map(int, args.fp8_tokens.split(",")):
            x, w, ids = e8.inputs(t)
            rows.append(compare("fp8", t, {
                "old_grouped": lambda: old8.fp8_fused_moe(x, *w8, w, ids, "silu", grouped=True),
                "new_grouped": lambda: fp8_moe.fp8_fused_moe(x, *w8, w, ids, "silu", grouped=True),
                "new_table": lambda: fp8_moe.fp8_fused_moe(x, *w8, w, ids, "silu")}))
        del e8
        e4 = fp4_sweep.Experts()
        for t in map(int, args.fp4_tokens.split(",")):
            x, w, ids = e4.inputs(t)
            rows.append(compare("nvfp4", t, {
                "old_grouped": lambda: old4.fp4_fused_moe(x, *e4.fp4, w, ids, "silu", grouped=True),
                "new_grouped": lambda: fp4_moe.fp4_fused_moe(x, *e4.fp4, w, ids, "silu", grouped=True),
                "new_table": lambda: fp4_moe.fp4_fused_moe(x, *e4.fp4, w, ids, "silu")}))
    (args.out / "moe_epilogue_ab.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows},
                                                              indent=1))


if __name__ == "__main__":
    main()
