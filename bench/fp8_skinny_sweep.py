"""FP8 decode GEMV (``fp8_skinny``) launch-config sweep at the Qwen3.6 projection shapes, and the tuning entry it picks.

    python bench/fp8_skinny_sweep.py                     # H200: M in 1, 2, 4, 8; results to $OUT (or --out)
    python bench/fp8_skinny_sweep.py --write             # also merge the entry into the installed Qwen table
    python bench/fp8_skinny_sweep.py --rows 16,32,64     # other M (64 streams' decode)
    python bench/fp8_skinny_sweep.py --rows 8,16,32,64 --only dot_scale_w=true   # one candidate family beside the picks
    python bench/fp8_skinny_sweep.py --smoke --out DIR   # CPU (TRITON_INTERPRET=1): tiny shapes, 2 candidates a path

Shapes: every ``ops.fp8_linear`` a decode step of ``Qwen3_5MoeTextConfig()`` makes with ``quantization=
"fp8_block"``, recorded by calling each fp8 linear layer of the plugin's model built on the meta device (the
shared expert is expert E of the fused MoE, the router stays bf16: neither goes through ``fp8_linear``).
Weights: random, 128 x 128 block e4m3 by ``armillary.kernels.fp8.quantize_blocks``, copies rotated so that
> 120 MB stream per pass (the L2 is 50 MB). For each (shape, M) the current table pick (``decode_config``
under the Qwen plugin's tables) and every candidate table entry (one-row path for M = 1, the tensor-core
path above; derived by ``decode_config`` itself with the entry patched in) are timed inside one CUDA graph
of >= 20 back-to-back calls (``skinny_gemm.time_calls``), beside bf16 cuBLAS on the dequantized weight and,
for M > 1, ``fp8_linear``'s prefill route (W8A8: activation quantization, then cuBLAS or the Triton GEMM). A
candidate counts when its error vs the fp32 dequantized product is within max(2 x cuBLAS's, 8e-3), its
output is bit-equal across calls and graph replays, and the split-K tickets are back at 0. Grid pruning: one-row
tiles holding 16..128 fp32 accumulators a thread (34 of the 48 BLOCK_N x BLOCK_K x warps), splits that divide K's
tiles while the split before gave fewer than 6 waves on 132 SMs. Candidates compile first in worker processes.
Writes ``fp8_skinny_sweep.json`` (every measurement) and ``fp8_skinny_table.json`` (``{"fp8_skinny": {key: table
keys}}`` for the keys whose best beats the current pick by > ``--min-gain``); ``--write`` merges that into the
Qwen plugin's ``tuning/sm_90.json`` as installed (``importlib.resources``; ``--table``: another file), every other
entry kept, and reads it back.
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

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autotune import table_path  # noqa: E402
from skinny_gemm import compile_in_workers, rel_err, time_calls  # noqa: E402
from sweep_checks import SkinnySweep, add_sweep_arguments, checked_timing, output_folder, patched_lookup  # noqa: E402

from armillary.kernels import fp8 as ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp8_skinny as fs  # noqa: E402
from armillary.kernels.triton.fp8_gemm import fp8_linear  # noqa: E402

QWEN = "armillary_qwen_gdn_moe"
BLOCK = 128  # the weight's (bn, bk): the published FP8 checkpoint's and --quantization fp8_block's
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # the interpreter miscomputes bf16 tl.dot
ROWS = (1, 3) if SMOKE else (1, 2, 4, 8)
SMOKE_SHAPES = {(72, 256): ["smoke_a"], (40, 512): ["smoke_b"]}  # K > 128: the block-scaled path
ROTATE_BYTES = 0 if SMOKE else 120e6
SPLITS = (1, 2) if SMOKE else (1, 2, 4, 8)
SMS = 132  # H200: splits stop once the previous split count already made 6 waves
ACC_PER_THREAD = (16, 128)  # one-row tiles: fp32 accumulators a thread holds (16 bytes a load .. no spills)
ONE_ROW_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "split_k")
DOT_KEYS = ("DOT_BLOCK_N", "DOT_BLOCK_K", "dot_num_warps", "dot_num_stages", "dot_unroll", "dot_scale_w", "split_k")
if SMOKE:
    ONE_ROW_GRID = [dict(BLOCK_N=8, BLOCK_K=128, num_warps=2)]
    DOT_GRID = [dict(DOT_BLOCK_N=16, DOT_BLOCK_K=128, dot_num_warps=4, dot_num_stages=2, dot_unroll=u, dot_scale_w=sw)
                for u in (False, True) for sw in (False, True)]
else:
    ONE_ROW_GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024, 2048)
                    for w in (2, 4, 8) if ACC_PER_THREAD[0] <= bn * bk // (32 * w) <= ACC_PER_THREAD[1]]
    DOT_GRID = [dict(DOT_BLOCK_N=bn, DOT_BLOCK_K=128, dot_num_warps=w, dot_num_stages=s, dot_unroll=False,
                     dot_scale_w=False) for bn in (16, 32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    # straight-line tiles: num_stages does nothing there
    DOT_GRID += [dict(DOT_BLOCK_N=bn, DOT_BLOCK_K=128, dot_num_warps=w, dot_num_stages=1, dot_unroll=True,
                      dot_scale_w=False) for bn in (16, 32, 64, 128) for w in (4, 8)]
    # block scales on the widened weights: one accumulator chain, no wait on each tile's product
    DOT_GRID += [dict(DOT_BLOCK_N=bn, DOT_BLOCK_K=128, dot_num_warps=w, dot_num_stages=s, dot_unroll=False,
                      dot_scale_w=True) for bn in (16, 32, 64, 128) for w in (4, 8) for s in (3, 4)]
    DOT_GRID += [dict(DOT_BLOCK_N=bn, DOT_BLOCK_K=128, dot_num_warps=4, dot_num_stages=1, dot_unroll=True,
                      dot_scale_w=True) for bn in (16, 32, 64, 128)]


def fp8_decode_shapes(tiny: bool) -> dict[tuple[int, int], list[str]]:
    """{(N, K): names of the layers} of every ``ops.fp8_linear`` call of one decode step, one name per call
    (a layer per decoder layer repeats): each fp8 linear layer of the meta model called on one token."""
    from qwen_bench import real_config

    from armillary.hf_config import HFConfig
    from armillary.kernels import ops
    from armillary.layers.linear import LinearBase
    from armillary.layers.quantization import use_quant_config
    from armillary.layers.quantization.context import resolve_quant_config
    from armillary.layers.quantization.fp8_methods import Fp8LinearMethod, OnlineFp8LinearMethod
    from armillary.registry import default_registry

    cfg = json.loads(json.dumps(real_config(tiny)))
    registry = default_registry()
    arch = registry.resolve_architecture(cfg["architectures"])
    module, _, name = arch.model_cls.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    saved_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with use_quant_config(resolve_quant_config(cfg, registry, "fp8_block")), torch.device("meta"):
            net = cls(HFConfig(cfg))
    finally:
        torch.set_default_dtype(saved_dtype)
    calls: list[tuple[int, int, tuple[int, int]]] = []

    def record(x, weight, scale, block_n, block_k, bias=None):
        calls.append((weight.shape[0], weight.shape[1], (block_n, block_k)))
        return x.new_empty(x.shape[0], weight.shape[0])

    shapes: dict[tuple[int, int], list[str]] = {}
    saved_linear = ops.fp8_linear
    ops.fp8_linear = record
    try:
        for path, mod in net.named_modules():
            if isinstance(mod, LinearBase) and isinstance(mod.quant_method, (Fp8LinearMethod, OnlineFp8LinearMethod)):
                mod.quant_method.process_weights_after_loading(mod)  # online: bf16 -> fp8 + scales (meta)
                before = len(calls)
                mod(torch.empty(1, mod.input_size_per_partition, device="meta", dtype=torch.bfloat16))
                for n, k, block in calls[before:]:
                    if block != (BLOCK, BLOCK):
                        raise RuntimeError(f"{path}: fp8 blocks {block}, the sweep quantizes {BLOCK} x {BLOCK}")
                    shapes.setdefault((n, k), []).append(path.rsplit(".", 1)[-1])
    finally:
        ops.fp8_linear = saved_linear
    return shapes


def derive(m: int, n: int, k: int, entry: dict | None = None) -> dict:
    """The launch keys ``decode_config`` gives with ``entry`` in the table (None: the tables as they are)."""
    with patched_lookup(fs, entry or {}):
        return fs.decode_config(m, n, k, BLOCK, BLOCK, DEVICE)


def candidates(m: int, n: int, k: int, current: dict) -> list[tuple[dict, dict]]:
    """(table entry, derived launch keys) of each candidate, distinct and not the current pick: splits that
    divide K's tiles, and only while the unsplit grid is short of ~6 waves."""
    out, seen = [], {json.dumps(current, sort_keys=True)}
    for base in ONE_ROW_GRID if m == 1 else DOT_GRID:
        for split in SPLITS:
            entry = {**base, "split_k": split}
            cfg = derive(m, n, k, entry)
            k_blocks = math.ceil(k / (cfg["NSUB"] * cfg["SUB_K"]))
            tiles = math.ceil(n / cfg["BLOCK_N"]) * math.ceil(m / cfg["BLOCK_M"])
            if k_blocks % split or cfg["split_k"] != split or (split > 1 and tiles * split // 2 >= 6 * SMS):
                continue
            key = json.dumps(cfg, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((entry, cfg))
    return out


def make_weights(n: int, k: int, copies: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [ref.quantize_blocks((torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(DTYPE), BLOCK, BLOCK)
            for _ in range(copies)]


_WORKER_INPUTS: dict = {}


def warm_init() -> None:
    tuning.use_packages((QWEN,))  # the same PDL decision (a constexpr) as the timed process


def warm_one(job: tuple) -> bool:
    """Compiles one specialisation by launching it once: (N, K, M, launch keys)."""
    n, k, m, cfg = job
    try:
        if (n, k, m) not in _WORKER_INPUTS:
            (q, s), = make_weights(n, k, 1, 0)
            _WORKER_INPUTS[(n, k, m)] = (torch.randn(m, k, device=DEVICE, dtype=DTYPE), q, s)
        x, q, s = _WORKER_INPUTS[(n, k, m)]
        fs.fp8_skinny_gemm(x, q, s, BLOCK, BLOCK, config=cfg)
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
        key = json.dumps({**cfg, "split_k": None, "even": k % (cfg["NSUB"] * cfg["SUB_K"] * cfg["K_TILES"]),
                          "n16": n % 16}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            distinct.append((n, k, m, cfg))
    if workers <= 1 or SMOKE:
        return {"specialisations": len(distinct), "compiled_in_workers": 0}
    start = time.time()
    ok = compile_in_workers(warm_one, distinct, workers, budget_s, initializer=warm_init)
    return {"specialisations": len(distinct), "compiled_in_workers": ok, "warm_s": time.time() - start}


def time_config(x, weights, cfg: dict, want: torch.Tensor, tol: float, gbps) -> dict:
    """One launch config: µs per call in a graph, error, bit-stability, tickets; ``ok`` when it may count."""
    return checked_timing(lambda i: fs.fp8_skinny_gemm(x, *weights[i], BLOCK, BLOCK, config=cfg), len(weights), want,
                          tol, gbps)


def sweep_shape(names: list[str], n: int, k: int, m: int, weights, dense, deadline: float) -> dict:
    """cuBLAS, the current pick and every candidate at one (shape, M)."""
    fp8_bytes = n * k + 4 * math.ceil(n / BLOCK) * math.ceil(k / BLOCK) + 2 * m * (k + n)
    gbps = lambda us: fp8_bytes / (us * 1e-6) / 1e9  # noqa: E731
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
    want = x.float() @ ref.dequantize(*weights[0], BLOCK, BLOCK).T  # [M, N] fp32
    cublas_us, outs = time_calls(lambda i: F.linear(x, dense[i]), len(dense))
    bf16_bytes = 2 * n * k + 2 * m * (k + n)
    row = {"shape": "+".join(sorted(set(names))), "launches_per_step": len(names), "N": n, "K": k, "M": m,
           "key": fs.config_key(m, n, k), "weight_copies": len(weights), "cublas_us": cublas_us,
           "cublas_GBps": bf16_bytes / (cublas_us * 1e-6) / 1e9, "cublas_err": rel_err(outs[0], want), "configs": []}
    if m > 1:  # the W8A8 route fp8_linear takes past DECODE_MAX_ROWS rows, for the crossover
        w8a8_us, outs = time_calls(lambda i: fp8_linear(x, *weights[i], BLOCK, BLOCK, config={"prefill": True}),
                                   len(weights))
        row.update(w8a8_us=w8a8_us, w8a8_err=rel_err(outs[0], want))
    tol = max(2.0 * row["cublas_err"], 8e-3)
    current = derive(m, n, k)
    runs = [(None, current, "current"), *[(e, c, "sweep") for e, c in candidates(m, n, k, current)]]
    for entry, cfg, source in runs:
        if source == "sweep" and time.time() > deadline:
            row["truncated"] = True
            break
        row["configs"].append({"source": source, "entry": entry, "config": cfg,
                               **time_config(x, weights, cfg, want, tol, gbps)})
    return row


def summarise(row: dict, min_gain: float) -> dict:
    """Current pick, best counted config, and the table entry (only table keys) where the best wins."""
    good = [c for c in row["configs"] if c.get("ok")]
    cur = row["configs"][0] if row["configs"] and row["configs"][0]["source"] == "current" else {}
    best = min(good, key=lambda c: c["us"], default=None)
    rival = min((c for c in good if c["source"] == "sweep"), key=lambda c: c["us"], default=None)
    out = {"key": row["key"], "current_us": cur.get("us"), "current_GBps": cur.get("GBps"), "current_ok": cur.get("ok"),
           "current": cur.get("config"), "bad_configs": sum(1 for c in row["configs"] if not c.get("ok")),
           "timed": len(row["configs"]), "cublas_us": row["cublas_us"]}
    if best is not None:
        out.update(best_us=best["us"], best_GBps=best["GBps"], best_err=best["err"], best=best["config"],
                   best_entry=best["entry"])
    if rival is not None and (not cur.get("ok") or rival["us"] < (1.0 - min_gain) * cur["us"]):
        keys = ONE_ROW_KEYS if row["M"] == 1 else DOT_KEYS
        out.update(entry={key: rival["entry"][key] for key in keys if key in rival["entry"]},
                   entry_config=rival["config"],
                   entry_us=rival["us"])
    return out


def report_line(row: dict, s: dict) -> str:
    """One (shape, M): the current pick, the best counted config and bf16 cuBLAS, µs and GB/s."""
    fmt = lambda v: f"{v:8.2f}" if v is not None else "       -"  # noqa: E731
    best = json.dumps(s["best_entry"]) if s.get("best_entry") else "(the current pick)"
    speedup = (s["current_us"] or 0) / s.get("best_us", math.inf)
    w8a8 = f" | W8A8 route {row['w8a8_us']:8.2f} us err {row['w8a8_err']:.1e}" if "w8a8_us" in row else ""
    return (f"{row['shape']:16s} M={row['M']} current {fmt(s['current_us'])} us {s['current_GBps'] or 0:6.0f} GB/s"
            f"{'' if s['current_ok'] else ' (FAILS its checks)'} | best {fmt(s.get('best_us'))} us "
            f"{s.get('best_GBps', 0):6.0f} GB/s x{speedup:.2f} {best} | bf16 cuBLAS {fmt(row['cublas_us'])} us "
            f"{row['cublas_GBps']:6.0f} GB/s{w8a8} | err {s.get('best_err', float('nan')):.1e} bad {s['bad_configs']}/"
            f"{s['timed']}{' -> table' if 'entry' in s else ''}{' TRUNCATED' if row.get('truncated') else ''}")


def device_name() -> str:
    return "cpu-interpreter" if SMOKE else torch.cuda.get_device_name()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap, 150.0)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny shapes, the plumbing only")
    ap.add_argument("--rows", default=None, help="comma-separated M values (default: 1,2,4,8)")
    ap.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                    help="time only grid entries with this value (JSON), e.g. dot_scale_w=true; entries "
                         "without the key stay")
    args = ap.parse_args()
    global ONE_ROW_GRID, DOT_GRID
    for only in args.only:
        key, _, value = only.partition("=")
        want = json.loads(value)
        ONE_ROW_GRID, DOT_GRID = ([g for g in grid if g.get(key, want) == want] for grid in (ONE_ROW_GRID, DOT_GRID))
    rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else ROWS
    start = time.time()
    out = output_folder(ap, args, SMOKE)
    tuning.use_packages((QWEN,))  # the tables as the served Qwen model reads them
    import triton

    from armillary.kernels.triton.pdl import pdl_enabled

    model_shapes = fp8_decode_shapes(tiny=SMOKE)
    for (n, k), names in model_shapes.items():
        print(f"fp8_linear n{n}_k{k}: {len(names)} launches a step ({', '.join(sorted(set(names)))})", flush=True)
    shapes = SMOKE_SHAPES if SMOKE else model_shapes
    results = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "pdl": pdl_enabled(DEVICE), "command": " ".join(sys.argv), "date": str(datetime.date.today()),
               "model_shapes": {f"n{n}_k{k}": names for (n, k), names in model_shapes.items()},
               "rows": [], "summary": []}
    sweep = SkinnySweep("fp8_skinny_sweep.py", fs.KERNEL, rows, ROTATE_BYTES, lambda n, k: n * k, make_weights,
                        lambda w: ref.dequantize(*w, BLOCK, BLOCK, DTYPE), derive, candidates, warm_compile,
                        sweep_shape, summarise, report_line)
    return sweep.run(shapes, results, args, out, args.table or Path(table_path(QWEN, "sm_90")), start)


if __name__ == "__main__":
    sys.exit(main())
