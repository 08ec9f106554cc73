"""Skinny GEMM (decode projections) vs cuBLAS: timing, correctness and the tuning-table entry.

    python bench/skinny_gemm.py --out DIR            # H200: the Qwen3.6 projections, M in 1..16 (<= 90 s)
    python bench/skinny_gemm.py --out DIR --model glm   # a plugin model's decode projections, M in 1..8
    python bench/skinny_gemm.py --out DIR --model all   # nemotron, glm, gemma4, gemma3 one after another
    python bench/skinny_gemm.py --out DIR --smoke    # CPU (TRITON_INTERPRET=1): tiny shapes, logic only

For each shape y[M, N] = x[M, K] @ W[N, K]^T (bf16) and M, cuBLAS (F.linear) and every candidate
config (path, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) x split_k are timed inside one CUDA graph
of >= 20 back-to-back calls that rotate over distinct weight copies (> 120 MB per pass, so the
50 MB L2 does not serve W). Errors are max|y - ref| / max|ref| against the fp32 product; split
configs are also checked bit-for-bit across calls and graph replays, with their tickets back at 0.
Writes DIR/skinny_gemm.json (every measurement), DIR/skinny_gemm_table.json (the "skinny_gemm" entry
of the first model's plugin table) and DIR/skinny_gemm_tables.json ({package: {"skinny_gemm": entry}},
Gemma 3 and 4 merged into the gemma plugin's). Plugin models' shapes come from decode_shapes.py (every
``ops.linear`` of the model at the bench config's size). Candidates compile first in worker processes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from armillary.kernels.triton import skinny_gemm as sg  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton.device_buffers import ticket_buffer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PLUGIN_MODELS = ("nemotron", "glm", "gemma4", "gemma3")  # --model all
QWEN_PACKAGE = "armillary_qwen_gdn_moe"

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # the interpreter miscomputes bf16
SHAPES = {  # name: (N, K); GDN out_proj and attention o_proj share (2048, 4096)
    "gdn_in_proj": (12352, 2048),
    "out_proj": (2048, 4096),
    "attn_qkv": (9216, 2048),
    "router": (257, 2048),
}
ROWS = (1, 2, 4, 8, 16)
PLUGIN_ROWS = (1, 2, 4, 8)  # the plugin tables' batch 1..8
# (path, BLOCK_M (0: the rows), BLOCK_N, BLOCK_K, num_warps, num_stages); Triton pipelines (num_stages > 1)
# only the loads that feed tl.dot, so fma candidates run one stage and rely on several CTAs per SM
FMA_ONE = [("fma", 1, bn, bk, w, 1) for bn, bk, w in [(8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 4),
                                                     (32, 256, 4), (16, 1024, 8), (32, 512, 8), (8, 512, 2)]]
FMA_FEW = [("fma", 0, bn, bk, 4, 1) for bn, bk in [(16, 128), (16, 256), (32, 128), (8, 256)]]
DOT = [("dot", 16, bn, bk, w, s) for bn, bk, w, s in
       [(16, 128, 4, 1), (16, 256, 4, 1), (32, 128, 4, 1), (32, 256, 4, 1), (64, 128, 4, 1), (64, 256, 8, 1),
        (32, 128, 4, 3), (64, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (32, 128, 4, 4)]]  # fmt: skip
SPLITS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 120e6
CALLS = 20
WIN = 0.97  # the kernel must be 3% faster than cuBLAS to be marked "use"
if SMOKE:
    SHAPES = {"in_proj": (67, 64), "out_proj": (24, 96), "router": (19, 64)}
    ROWS = (1, 3)
    FMA_ONE, FMA_FEW, DOT = [("fma", 1, 8, 32, 2, 1)], [("fma", 0, 8, 32, 2, 1)], [("dot", 16, 16, 32, 2, 1)]
    SPLITS, ROTATE_BYTES, CALLS = (1, 2), 0, 2
    PLUGIN_ROWS = ROWS


def model_shapes(model: str) -> tuple[str, dict[str, tuple[int, int]], tuple[int, ...]]:
    """(package, {name: (N, K)}, rows) of ``model``: Qwen's fixed list, or the plugin model's projections."""
    if model == "qwen":
        return QWEN_PACKAGE, SHAPES, ROWS
    from decode_shapes import PACKAGES, linear_shapes

    if SMOKE:  # two of the model's layer names on tiny shapes: the plumbing only
        names = ["+".join(v) for v in linear_shapes(model).values()][:2]
        return PACKAGES[model], dict(zip(names, [(67, 64), (24, 96)])), PLUGIN_ROWS
    return PACKAGES[model], {"+".join(v): nk for nk, v in linear_shapes(model).items()}, PLUGIN_ROWS


def candidates(rows: int) -> list[tuple]:
    return (FMA_ONE if rows == 1 else FMA_FEW if rows <= 4 else []) + DOT


def as_config(cand: tuple, split: int) -> dict:
    path, bm, bn, bk, warps, stages = cand
    return {"path": path, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
            "split_k": split}


def splits_for(n: int, k: int, rows: int, cand: tuple) -> list[int]:
    """Split counts worth timing: until the grid has a few waves of programs on 132 SMs."""
    _, bm, bn, bk, _, _ = cand
    tiles = math.ceil(n / bn) * math.ceil(rows / max(bm or rows, 16 if cand[0] == "dot" else 1))
    return [s for s in SPLITS if s == 1 or (s * bk <= k and tiles * s // 2 < 6 * 132)]


def make_inputs(n: int, k: int, rows: int, copies: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ws = [(torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE) for _ in range(copies)]
    x = torch.randn(rows, k, device=DEVICE, generator=g).to(DTYPE)
    return x, ws


def warm_worker(jobs: list[tuple]) -> int:
    """Compiles (one launch each) the candidate configs of ``jobs``: (N, K, rows, config)."""
    done = 0
    for n, k, rows, cfg in jobs:
        try:
            x, ws = make_inputs(n, k, rows, 1)
            sg.skinny_gemm(x, ws[0], config=cfg)
            done += 1
        except Exception as e:  # the timed run reports it
            print(f"warm {n}x{k} M={rows} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done


def warm_compile(workers: int, shapes: dict[str, tuple[int, int]], row_counts: tuple[int, ...]) -> None:
    """One launch per distinct specialisation (split_k is a runtime argument: split 1 only)."""
    jobs, seen = [], set()
    for n, k in shapes.values():
        for rows in row_counts:
            for cand in candidates(rows):
                bm = cand[1] or min(1 << (rows - 1).bit_length(), 16)
                key = (n % 16 == 0, cand[0], bm, cand[2:])
                if key not in seen:
                    seen.add(key)
                    jobs.append((n, k, rows, as_config(cand, 1)))
    if workers <= 1:
        return
    import multiprocessing as mp

    start = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(warm_worker, chunks))
    print(f"warm-up: {done}/{len(jobs)} specialisations compiled in {workers} processes, "
          f"{time.time() - start:.0f} s", flush=True)


def compile_in_workers(fn, jobs: list, workers: int, budget_s: float, initializer=None) -> int:
    """``fn(job)`` for each job in ``workers`` spawned processes (each launch compiles into Triton's disk cache)
    for at most ``budget_s``; returns how many returned True. The jobs not started by then compile when timed."""
    import multiprocessing as mp
    from concurrent.futures import wait

    start = time.time()
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=initializer)
    futures = [pool.submit(fn, job) for job in jobs]
    done, pending = wait(futures, timeout=max(1.0, budget_s))
    pool.shutdown(wait=True, cancel_futures=True)  # the running compiles finish before anything is timed
    ok = sum(1 for f in done if not f.cancelled() and f.exception() is None and f.result())
    print(f"warm-up: {ok}/{len(jobs)} compiled in {workers} processes, {time.time() - start:.0f} s"
          f"{f' ({len(pending)} left to the timed run)' if pending else ''}", flush=True)
    return ok


def time_calls(fn, copies: int) -> tuple[float, list]:
    """µs per call of ``fn(i)`` for i over the weight copies: CALLS+ calls captured in one graph.
    Returns (µs, the outputs the graph writes). Smoke mode: wall clock of eager calls."""
    calls = max(CALLS, copies)
    if SMOKE:
        start = time.perf_counter()
        outs = [fn(i % copies) for i in range(calls)]
        return (time.perf_counter() - start) * 1e6 / calls, outs
    fn(0)  # eager first: compiles, allocates the tickets outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            outs = [fn(i % copies) for i in range(calls)]
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls), outs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def tickets_clear() -> bool:
    return not bool(ticket_buffer(torch.device(DEVICE), 0).any())


def bench_shape(name: str, n: int, k: int, rows: int, deadline: float) -> dict:
    """cuBLAS and every candidate at one (shape, M); the row for the report."""
    wbytes = n * k * torch.finfo(DTYPE).bits // 8
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    x, ws = make_inputs(n, k, rows, copies)
    ref = sg.skinny_reference(x, ws[0])
    moved = wbytes + (rows * k + rows * n) * x.element_size()
    gbps = lambda us: moved / (us * 1e-6) / 1e9  # noqa: E731
    cublas_us, outs = time_calls(lambda i: F.linear(x, ws[i]), copies)
    row = {"shape": name, "N": n, "K": k, "M": rows, "weight_copies": copies, "cublas_us": cublas_us,
           "cublas_GBps": gbps(cublas_us), "cublas_err": rel_err(outs[0], ref), "configs": []}
    table = sg.lookup_config(rows, n, k, x.device)
    row["table_use"] = bool(table["use"])
    runs = [({key: table[key] for key in as_config(DOT[0], 1)}, "table")]  # what ops.linear runs now
    runs += [(as_config(c, s), "sweep") for c in candidates(rows) for s in splits_for(n, k, rows, c)]
    for cfg, source in runs:
        if time.time() > deadline:
            row["truncated"] = True
            return row
        entry = {"config": cfg, "source": source}
        try:
            eager = sg.skinny_gemm(x, ws[0], config=cfg)
            again = sg.skinny_gemm(x, ws[0], config=cfg)
            us, outs = time_calls(lambda i: sg.skinny_gemm(x, ws[i], config=cfg), copies)
            entry.update(us=us, GBps=gbps(us), err=rel_err(eager, ref),
                         stable=bool(torch.equal(eager, again) and torch.equal(eager, outs[0])),
                         tickets_clear=tickets_clear())
            entry["ok"] = entry["stable"] and entry["tickets_clear"] and \
                entry["err"] <= max(2.0 * row["cublas_err"], 8e-3)
        except Exception as e:  # a config that does not compile or fit: report, keep going
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        row["configs"].append(entry)
    return row


def summarise(row: dict) -> dict:
    """Best good config overall and per path; whether it beats cuBLAS."""
    good = [c for c in row["configs"] if c.get("ok")]
    best = min(good, key=lambda c: c["us"], default=None)
    out = {"shape": row["shape"], "M": row["M"], "cublas_us": row["cublas_us"], "cublas_GBps": row["cublas_GBps"],
           "bad_configs": sum(1 for c in row["configs"] if not c.get("ok")), "table_use": row.get("table_use"),
           "table_us": next((c["us"] for c in good if c["source"] == "table"), None)}
    for path in ("fma", "dot"):
        b = min((c for c in good if c["config"]["path"] == path), key=lambda c: c["us"], default=None)
        out[f"best_{path}_us"] = b["us"] if b else None
    if best:
        out.update(best_us=best["us"], best_GBps=best["GBps"], best_err=best["err"], best=best["config"],
                   wins=best["us"] < WIN * row["cublas_us"], speedup=row["cublas_us"] / best["us"])
    return out


def table_entry(summaries: list[dict], shapes: dict[str, tuple[int, int]] | None = None) -> dict:
    """The "skinny_gemm" tuning entry: one key per (N, K, M bucket), "use" where the kernel wins."""
    shapes = SHAPES if shapes is None else shapes
    entry: dict = {"_comment": f"bench/skinny_gemm.py on {results_device()}; keys n{{N}}_k{{K}}_m{{rows "
                               f"rounded up to 2^i}}; use: beats cuBLAS by > {100 * (1 - WIN):.0f}%"}
    winning_rows = [s["M"] for s in summaries if s.get("wins")]
    entry["default"] = {"max_rows": max(winning_rows, default=8)}
    for s in summaries:
        if "best" not in s:
            continue
        n, k = shapes[s["shape"]]
        cfg = {key: v for key, v in s["best"].items()}
        entry[sg.config_key(s["M"], n, k)] = {"use": bool(s["wins"]), **cfg}
    return entry


def results_device() -> str:
    return "cpu-interpreter" if SMOKE else torch.cuda.get_device_name()


def bench_model(model: str, args, results: dict) -> tuple[str, dict]:
    """Every shape of ``model`` at each row count: (package, its "skinny_gemm" entry); rows into ``results``."""
    package, shapes, row_counts = model_shapes(model)
    tuning.use_packages((package,))  # the shipped tables as the served model reads them
    start = time.time()
    budget = args.budget_s if args.budget_s is not None else (85.0 if model == "qwen" else 20.0 * len(shapes))
    deadline = start + budget
    print(f"== {model} ({package}): {len(shapes)} shapes x M {row_counts}, budget {budget:.0f} s", flush=True)
    warm_compile(args.workers, shapes, row_counts)
    summaries = []
    for rows in row_counts:  # every shape at M = 1 first: the budget, if short, cuts the larger M
        for name, (n, k) in shapes.items():
            try:
                row = bench_shape(name, n, k, rows, deadline)
            except Exception as e:  # keep going: one broken shape must not hide the others
                row = {"shape": name, "N": n, "K": k, "M": rows, "error": f"{type(e).__name__}: {str(e)[:300]}",
                       "configs": []}
                print(json.dumps(row), flush=True)
                results["rows"].append({"model": model, **row})
                continue
            results["rows"].append({"model": model, **row})
            s = summarise(row)
            summaries.append({"model": model, **s})
            fmt = lambda v: f"{v:8.2f}" if v is not None else "       -"  # noqa: E731
            print(f"{name:12} M={rows:2d} cuBLAS {row['cublas_us']:8.2f} us {row['cublas_GBps']:6.0f} GB/s | "
                  f"table {fmt(s['table_us'])}{'*' if s['table_use'] else ' '} fma {fmt(s['best_fma_us'])} "
                  f"dot {fmt(s['best_dot_us'])} | best "
                  f"{fmt(s.get('best_us'))} us {s.get('best_GBps', 0):6.0f} GB/s x{s.get('speedup', 0):.2f} "
                  f"{'WIN ' if s.get('wins') else 'lose'} err {s.get('best_err', float('nan')):.1e} "
                  f"bad {s['bad_configs']} {s.get('best', '')}{' TRUNCATED' if row.get('truncated') else ''}",
                  flush=True)
            if not SMOKE:
                del row
                torch.cuda.empty_cache()
    results["summary"] += summaries
    return package, table_entry(summaries, shapes)


def merge_entries(have: dict | None, new: dict) -> dict:
    """Two models of one plugin (Gemma 3 and 4): both shape sets, the larger max_rows."""
    if have is None:
        return new
    merged = {**have, **{k: v for k, v in new.items() if k not in ("_comment", "default")}}
    merged["default"] = {"max_rows": max(have["default"]["max_rows"], new["default"]["max_rows"])}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workers", type=int, default=1 if SMOKE else min(12, os.cpu_count() or 1))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="per model: stop timing new configs after this (default 85 s Qwen, 20 s per shape)")
    parser.add_argument("--model", default="qwen", choices=("qwen", *PLUGIN_MODELS, "all"),
                        help="whose projections: qwen (default), a plugin model, or all plugin models")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    import triton

    results = {"device": results_device(), "torch": torch.__version__, "triton": triton.__version__, "rows": [],
               "summary": []}
    tables: dict[str, dict] = {}
    for model in PLUGIN_MODELS if args.model == "all" else (args.model,):
        package, entry = bench_model(model, args, results)
        tables[package] = {"skinny_gemm": merge_entries(tables.get(package, {}).get("skinny_gemm"), entry)}
        results["elapsed_s"] = time.time() - start
        with open(os.path.join(args.out, "skinny_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "skinny_gemm_tables.json"), "w") as f:
            json.dump(tables, f, indent=1)
    first = next(iter(tables))
    with open(os.path.join(args.out, "skinny_gemm_table.json"), "w") as f:
        json.dump(tables[first], f, indent=1)
    for package, table in tables.items():
        print(f"tuning entry for {package}/tuning/sm_90.json:")
        print(json.dumps(table))
    print(f"done in {time.time() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
