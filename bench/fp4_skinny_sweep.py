"""NVFP4 decode GEMV (``fp4_skinny``) launch-config sweep at the Qwen3.6 projection shapes, M = 1, 2, 4, 8, and the tuning entry it picks.

    python bench/fp4_skinny_sweep.py --deadline-s 110           # H200: results to $OUT (or --out)
    python bench/fp4_skinny_sweep.py --deadline-s 110 --write   # also merge the entry into the Qwen plugin's tuning/sm_90.json
    python bench/fp4_skinny_sweep.py --tiny --device cpu --out DIR [--write --table T]   # CPU interpreter smoke

Shapes: ``decode_shapes.linear_shapes("qwen")`` (GDN in_proj, o_proj / out_proj, attention qkv of Qwen3.6-35B-A3B;
``--tiny``: two odd ones). Weights: random, ``armillary.kernels.fp4.quantize_nvfp4`` with row global scales,
copies rotated so that > 120 MB stream per pass (the L2 is 50 MB). Per (shape, M) the current table pick and
every candidate entry (the one-row path at M = 1, the tensor-core path above; launch keys derived by
``fp4_gemv.decode_config`` with the entry patched in) are timed in one CUDA graph of >= 20 calls beside bf16
cuBLAS on the dequantized weight, and checked as fp8_skinny_sweep checks (``sweep_checks.checked_timing``: error
vs the fp32 dequantized product within max(2 x cuBLAS's, 8e-3), bit-stable, tickets back at 0). Candidates
compile first in worker processes; summaries and report lines are fp8_skinny_sweep's. Writes
``fp4_skinny_sweep.json`` and ``fp4_skinny_table.json`` (keys whose best beats the current pick by > ``--min-gain``);
``--write`` merges that into the Qwen plugin's ``tuning/sm_90.json`` (``--table``: another file), every
other entry kept, and reads it back.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path


def _argv_device() -> str:
    """--device before argparse runs: the interpreter must be chosen before triton is imported."""
    for i, arg in enumerate(sys.argv):
        if arg == "--device" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "cuda"


CPU = _argv_device() == "cpu"
TINY = "--tiny" in sys.argv
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import skinny_gemm  # noqa: E402
from autotune import table_path  # noqa: E402
from decode_shapes import linear_shapes  # noqa: E402
from fp8_skinny_sweep import ACC_PER_THREAD, SMS, report_line, summarise  # noqa: E402
from skinny_gemm import compile_in_workers, rel_err, time_calls  # noqa: E402
from sweep_checks import SkinnySweep, add_sweep_arguments, checked_timing, output_folder, patched_lookup  # noqa: E402

from armillary.kernels import fp4 as ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp4_gemv  # noqa: E402

skinny_gemm.SMOKE, skinny_gemm.DEVICE = CPU, "cpu" if CPU else "cuda"  # time_calls: eager wall clock on the CPU
if CPU:
    skinny_gemm.CALLS = 2  # interpreted launches take ~1 s: the plumbing, not a timing
QWEN = "armillary_qwen_gdn_moe"
DEVICE = torch.device("cpu" if CPU else "cuda")
DTYPE = torch.float16 if CPU else torch.bfloat16  # the interpreter miscomputes bf16 tl.dot
ROWS = (1, 3) if TINY else (1, 2, 4, 8)
TINY_SHAPES = {(72, 256): ["tiny_a"], (40, 160): ["tiny_b"]}  # 160: K tiles past K (the masked path)
ROTATE_BYTES = 0 if TINY else 120e6
SPLITS = (1, 2) if TINY else (1, 2, 4, 8)
if TINY:
    ONE_ROW_GRID = [dict(BLOCK_N=8, BLOCK_K=64, num_warps=2)]
    DOT_GRID = [dict(DOT_BLOCK_N=16, DOT_BLOCK_K=64, dot_num_warps=4, dot_num_stages=2)]
else:  # one-row: [BN, BK / 8] int32 words and as many fp32 sums a tile, fp8_skinny_sweep's bounds per thread
    ONE_ROW_GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (4, 8, 16, 32) for bk in (512, 1024, 2048, 4096)
                    for w in (2, 4, 8) if ACC_PER_THREAD[0] <= bn * bk // 4 // (32 * w) <= ACC_PER_THREAD[1]]
    DOT_GRID = [dict(DOT_BLOCK_N=bn, DOT_BLOCK_K=bk, dot_num_warps=w, dot_num_stages=s) for bn in (16, 32, 64)
                for bk in (128, 256) for w in (4, 8) for s in (3, 4)]  # 24: ~340 compiles in all fit the budget


def derive(m: int, n: int, k: int, entry: dict | None = None) -> dict:
    """The launch keys ``decode_config`` gives with ``entry`` in the table (None: the tables as they are)."""
    with patched_lookup(fp4_gemv, entry or {}):
        return fp4_gemv.decode_config(m, n, k, DEVICE)


def candidates(m: int, n: int, k: int, current: dict) -> list[tuple[dict, dict]]:
    """(table entry, derived launch keys) of each distinct candidate that is not the current pick: splits that
    divide K's tiles, and only while the unsplit grid is short of ~6 waves."""
    out, seen = [], {json.dumps(current, sort_keys=True)}
    for base in ONE_ROW_GRID if m == 1 else DOT_GRID:
        for split in SPLITS:
            entry = {**base, "split_k": split}
            cfg = derive(m, n, k, entry)
            k_blocks = math.ceil(k / cfg["BLOCK_K"])
            tiles = math.ceil(n / cfg["BLOCK_N"]) * math.ceil(m / cfg["BLOCK_M"])
            if k_blocks % split or cfg["split_k"] != split or (split > 1 and tiles * split // 2 >= 6 * SMS):
                continue
            key = json.dumps(cfg, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((entry, cfg))
    return out


def make_weights(n: int, k: int, copies: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(packed [N, K / 2], e4m3 scales [N, K / 16], fp32 row globals [N]) per copy."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for _ in range(copies):
        packed, scale, glob = ref.quantize_nvfp4(torch.randn(n, k, device=DEVICE, generator=g) * 0.02)
        out.append((packed, scale, ref.row_global_scale(glob, n).to(DEVICE)))
    return out


_WORKER_INPUTS: dict = {}


def warm_init() -> None:
    tuning.use_packages((QWEN,))  # the same PDL decision (a constexpr) as the timed process


def warm_one(job: tuple) -> bool:
    """Compiles one specialisation by launching it once: (N, K, M, launch keys)."""
    n, k, m, cfg = job
    try:
        if (n, k, m) not in _WORKER_INPUTS:
            _WORKER_INPUTS[(n, k, m)] = (torch.randn(m, k, device=DEVICE, dtype=DTYPE), *make_weights(n, k, 1, 0)[0])
        x, *w = _WORKER_INPUTS[(n, k, m)]
        fp4_gemv.fp4_skinny_gemm(x, *w, None, cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return True
    except Exception as e:  # the timed run reports it
        print(f"warm n{n}_k{k}_m{m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return False


def warm_compile(jobs: list[tuple], workers: int, budget_s: float) -> dict:
    """One launch per distinct specialisation (split_k and M are runtime arguments), in ``workers`` processes."""
    distinct, seen = [], set()
    for n, k, m, cfg in jobs:
        key = json.dumps({**cfg, "split_k": None, "even": k % (cfg["BLOCK_K"] * cfg["K_TILES"]), "n16": n % 16},
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            distinct.append((n, k, m, cfg))
    if workers <= 1 or CPU:
        return {"specialisations": len(distinct), "compiled_in_workers": 0}
    start = time.time()
    ok = compile_in_workers(warm_one, distinct, workers, budget_s, initializer=warm_init)
    return {"specialisations": len(distinct), "compiled_in_workers": ok, "warm_s": time.time() - start}


def sweep_shape(names: list[str], n: int, k: int, m: int, weights, dense, deadline: float) -> dict:
    """cuBLAS, the current pick and every candidate at one (shape, M), rows as fp8_skinny_sweep's."""
    fp4_bytes = n * k // 2 + n * k // 16 + 4 * n + 2 * m * (k + n)  # codes, e4m3 group scales, row globals, x / y
    gbps = lambda us: fp4_bytes / (us * 1e-6) / 1e9  # noqa: E731
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
    want = x.float() @ ref.dequantize(*weights[0]).T  # [M, N] fp32
    cublas_us, outs = time_calls(lambda i: F.linear(x, dense[i]), len(dense))
    bf16_bytes = 2 * n * k + 2 * m * (k + n)
    row = {"shape": "+".join(sorted(set(names))), "launches_per_step": len(names), "N": n, "K": k, "M": m,
           "key": fp4_gemv.config_key(m, n, k), "weight_copies": len(weights), "cublas_us": cublas_us,
           "cublas_GBps": bf16_bytes / (cublas_us * 1e-6) / 1e9, "cublas_err": rel_err(outs[0], want), "configs": []}
    tol = max(2.0 * row["cublas_err"], 8e-3)
    current = derive(m, n, k)
    runs = [(None, current, "current"), *[(e, c, "sweep") for e, c in candidates(m, n, k, current)]]
    for entry, cfg, source in runs:
        if source == "sweep" and time.time() > deadline:
            row["truncated"] = True
            break
        timing = checked_timing(lambda i: fp4_gemv.fp4_skinny_gemm(x, *weights[i], None, cfg), len(weights), want,
                                tol, gbps)
        row["configs"].append({"source": source, "entry": entry, "config": cfg, **timing})
    return row


def device_name() -> str:
    return "cpu-interpreter" if CPU else torch.cuda.get_device_name()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap, 120.0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the Triton interpreter")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, two candidates a path: the plumbing only")
    args = ap.parse_args()
    start = time.time()
    out = output_folder(ap, args, CPU)
    tuning.use_packages((QWEN,))  # the tables as the served Qwen model reads them
    import triton

    from armillary.kernels.triton.pdl import pdl_enabled

    model_shapes = linear_shapes("qwen")
    for (n, k), names in model_shapes.items():
        print(f"fp4 linear n{n}_k{k}: {', '.join(names)}", flush=True)
    shapes = TINY_SHAPES if TINY else model_shapes
    results = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "pdl": pdl_enabled(DEVICE), "command": " ".join(sys.argv), "date": str(datetime.date.today()),
               "model_shapes": {f"n{n}_k{k}": names for (n, k), names in model_shapes.items()},
               "rows": [], "summary": []}
    sweep = SkinnySweep("fp4_skinny_sweep.py", fp4_gemv.KERNEL, ROWS, ROTATE_BYTES, lambda n, k: n * k // 2,
                        make_weights, lambda w: ref.dequantize(*w, dtype=DTYPE), derive, candidates, warm_compile,
                        sweep_shape, summarise, report_line)
    return sweep.run(shapes, results, args, out, args.table or table_path(QWEN, "sm_90"), start)


if __name__ == "__main__":
    sys.exit(main())
