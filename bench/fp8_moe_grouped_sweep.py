"""Launch-config sweep of the FP8 grouped MoE (``fp8_fused_moe`` grouped path: 64-stream decode and prefill) per rows-per-expert bucket, the whole call timed.

    python bench/fp8_moe_grouped_sweep.py --deadline-s 110           # H200: Qwen3.6 FP8 experts, JSON to $OUT
    python bench/fp8_moe_grouped_sweep.py --model nemotron           # a plugin model's expert shape, fp8 blocks
    python bench/fp8_moe_grouped_sweep.py --merge DIR/fp8_moe_grouped_table.json   # no GPU: merge a GPU run's
                                                                     # entry into that model's plugin's tuning/sm_90.json
    python bench/fp8_moe_grouped_sweep.py --tiny --device cpu --write --out DIR   # CPU interpreter (or --smoke):
                                                                     # tiny shapes, the merge into DIR/sm_90.json

Shape: Qwen3.6-35B-A3B-FP8 (H 2048, I 512, 256 routed experts + the shared one stacked as id 256, ids
[T, 8 + 1] with the shared id last), 128 x 128 block e4m3 weights (``fp8.quantize_blocks``); ``--model M``:
that plugin model's ``FusedMoE`` shape (decode_shapes.py) with the same blocks. One weight copy: every
token count streams far more than the 50 MB L2. Per token count (64: 64 decode streams, 2048 and 16384:
prefill chunks), at each BLOCK_M candidate: the up GEMM's (BLOCK_N1, num_warps1, num_stages1, GROUP_M1)
candidates with the down GEMM at today's tiles, then the down GEMM's with the best up; every run is the
whole ``fp8_fused_moe(..., grouped=True, tiles=cfg)`` call (activation quantization, align, both GEMMs,
the top-k sum), in a CUDA graph of 20 calls up to GRAPH_TOKENS tokens, CUDA events over eager calls above.
Each candidate's output is checked against the defaults' (norm ratio, <= 1e-2 and finite, else rejected).
A bucket's winner enters the table only when it beats the defaults by more than --min-gain (3%); the
defaults and the winner are timed once more, side by side, for the final figure. Candidates compile in
spawned worker processes first (Triton's disk cache). Writes $OUT/fp8_moe_grouped_sweep.json and
$OUT/fp8_moe_grouped_table.json ({"fp8_moe_grouped": {key: cfg}}).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv or "--tiny" in sys.argv and ("cpu" in sys.argv or "--device=cpu" in sys.argv)
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from armillary.kernels import fp8 as ref  # noqa: E402
from armillary.kernels.triton import fp8_moe  # noqa: E402
from autotune import merge, render, table_path  # noqa: E402
from decode_shapes import MODELS, PACKAGES, MoeShape, moe_shapes  # noqa: E402
from skinny_gemm import compile_in_workers, time_calls  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the interpreter miscomputes bf16
QWEN = MoeShape(experts=257, shared=1, pairs=9, hidden=2048, inter=512, activation="silu", gated=True)
BLOCK = (128, 128)
TOKENS = (64, 2048, 16384)
GRAPH_TOKENS = 4096  # up to this many tokens a call is timed in a CUDA graph; above, events over eager calls
EVENT_CALLS = 10
SMEM = 232448  # sm_90's shared memory per block: a pipeline stage holds a [BM, 128] and a [128, BN] e4m3 tile
TOL = 1e-2
# BLOCK_M candidates by average rows per expert (the first bucket with avg <= the bound)
BLOCK_MS = ((8, (16, 32, 64)), (64, (16, 32, 64)), (256, (32, 64, 128)), (1 << 30, (64, 128)))
# per GEMM: (BLOCK_N, num_warps, num_stages, GROUP_M); today's tiles at each BLOCK_M are timed first
TILES = [(64, 4, 4, 0), (128, 4, 3, 0), (128, 4, 5, 0), (128, 8, 4, 0), (128, 4, 4, 8), (256, 8, 3, 0),
         (256, 8, 4, 0), (64, 4, 5, 8), (128, 8, 3, 8)]
if SMOKE:
    QWEN = MoeShape(experts=6, shared=1, pairs=3, hidden=80, inter=48, activation="silu", gated=True)
    BLOCK, TOKENS = (16, 32), (3, 20)  # odd sizes: K tiles past H and I, N tiles past I
    BLOCK_MS = ((4, (16,)), (1 << 30, (16, 32)))
    TILES = [(16, 4, 1, 0), (64, 2, 1, 2)]


def tile_keys(tile: tuple, gemm: int) -> dict:
    return dict(zip((f"BLOCK_N{gemm}", f"num_warps{gemm}", f"num_stages{gemm}", f"GROUP_M{gemm}"), tile))


def tile_of(cfg: dict, gemm: int) -> tuple:
    return tuple(cfg[f"{key}{gemm}"] for key in ("BLOCK_N", "num_warps", "num_stages", "GROUP_M"))


def defaults_at(shape: MoeShape, tokens: int, block_m: int | None = None) -> dict:
    """Today's launch (no table) at ``block_m`` rows per tile (None: today's rows for this many pairs)."""
    return fp8_moe.grouped_defaults(tokens * shape.pairs, not SMOKE, block_m)


def fits(block_m: int, tile: tuple) -> bool:
    return SMOKE or tile[2] * (block_m + tile[0]) * BLOCK[1] <= SMEM


def block_ms(shape: MoeShape, tokens: int) -> tuple[int, ...]:
    avg = math.ceil(tokens * shape.pairs / shape.experts)
    return next(bms for bound, bms in BLOCK_MS if avg <= bound)


def plan(shape: MoeShape, tokens: int) -> list[tuple[int, list[tuple], list[tuple]]]:
    """(BLOCK_M, up tiles, down tiles) per BLOCK_M candidate, today's tiles first in each list."""
    out = []
    for bm in block_ms(shape, tokens):
        base = defaults_at(shape, tokens, bm)
        ups = [tile_of(base, 1)] + [t for t in TILES if t != tile_of(base, 1) and fits(bm, t)]
        downs = [tile_of(base, 2)] + [t for t in TILES if t != tile_of(base, 2) and fits(bm, t)]
        out.append((bm, ups, downs))
    return out


class Experts:
    """One copy of fp8 experts of ``shape`` (shared ones stacked last) with block scales, and routed inputs."""

    def __init__(self, shape: MoeShape, experts: int | None = None, empty: bool = False) -> None:
        self.shape, e = shape, experts or shape.experts
        rows = 2 * shape.inter if shape.gated else shape.inter
        if empty:  # compile-only: the values never matter
            self.w13 = torch.empty(e, rows, shape.hidden, device=DEVICE, dtype=torch.float8_e4m3fn)
            self.s13 = torch.ones(e, math.ceil(rows / BLOCK[0]), math.ceil(shape.hidden / BLOCK[1]), device=DEVICE)
            self.w2 = torch.empty(e, shape.hidden, shape.inter, device=DEVICE, dtype=torch.float8_e4m3fn)
            self.s2 = torch.ones(e, math.ceil(shape.hidden / BLOCK[0]), math.ceil(shape.inter / BLOCK[1]),
                                 device=DEVICE)
            return
        g = torch.Generator(device=DEVICE).manual_seed(1)
        self.w13, self.s13 = ref.quantize_blocks(torch.randn(e, rows, shape.hidden, device=DEVICE, generator=g,
                                                             dtype=DTYPE) * shape.hidden**-0.5, *BLOCK)
        self.w2, self.s2 = ref.quantize_blocks(torch.randn(e, shape.hidden, shape.inter, device=DEVICE, generator=g,
                                                           dtype=DTYPE) * shape.inter**-0.5, *BLOCK)

    def inputs(self, tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], weights [T, pairs] fp32, ids [T, pairs] int32: distinct routed ids, then the shared ones."""
        s, g = self.shape, torch.Generator().manual_seed(seed)
        routed = s.experts - s.shared
        ids = torch.rand(tokens, routed, generator=g).argsort(dim=1)[:, : s.pairs - s.shared]  # [T, k] distinct
        ids = torch.cat((ids, torch.arange(routed, s.experts).expand(tokens, s.shared)), dim=1)
        weights = torch.cat((torch.rand(tokens, s.pairs - s.shared, generator=g).softmax(-1),
                             torch.rand(tokens, s.shared, generator=g)), dim=1)
        x = torch.randn(tokens, s.hidden, generator=g)
        return x.to(DEVICE, DTYPE), weights.to(DEVICE), ids.to(DEVICE, torch.int32)

    def run(self, x, weights, ids, cfg: dict) -> torch.Tensor:
        return fp8_moe.fp8_fused_moe(x, self.w13, self.s13, self.w2, self.s2, *BLOCK, weights, ids,
                                     self.shape.activation, grouped=True, tiles=cfg)


def warm_worker(job: tuple) -> bool:
    """Compile one config's two GEMMs by one call on two empty experts of the real shape (the same
    specialisation: strides and a multiple-of-16 row count as the timed calls have)."""
    shape, cfg = job
    try:
        experts = Experts(shape, experts=2, empty=True)
        x, weights, ids = experts.inputs(16)
        experts.run(x, weights, ids.remainder(2), cfg)
        torch.cuda.synchronize()
        return True
    except Exception as e:  # the timed run reports it
        print(f"warm {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return False


def compile_jobs(shape: MoeShape, token_counts: list[int]) -> list[tuple]:
    """Every (BLOCK_M, up, down) the sweep may time first: up candidates with today's down, and the reverse."""
    seen, jobs = set(), []
    for tokens in token_counts:
        for bm, ups, downs in plan(shape, tokens):
            for up, down in [(u, downs[0]) for u in ups] + [(ups[0], d) for d in downs[1:]]:
                if (bm, up, down) not in seen:
                    seen.add((bm, up, down))
                    jobs.append((shape, {"BLOCK_M": bm, **tile_keys(up, 1), **tile_keys(down, 2)}))
    return jobs


def time_us(fn, tokens: int) -> tuple[float, torch.Tensor]:
    """µs per call of fn() and one output: wall clock off the GPU, a CUDA graph for small T, else events."""
    if SMOKE:
        fn()
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e6, out
    if tokens <= GRAPH_TOKENS:
        us, outs = time_calls(lambda i: fn(), 1)
        return us, outs[0]
    out = fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(EVENT_CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / EVENT_CALLS, out


def measure(experts: Experts, inputs: tuple, cfg: dict, want: torch.Tensor | None, tokens: int) -> dict:
    """One config: µs and its output's error against the defaults' (inf when it fails or is off)."""
    try:
        us, out = time_us(lambda: experts.run(*inputs, cfg), tokens)
    except Exception as e:  # over the shared memory, or an unsupported launch
        print(f"  {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {"config": cfg, "us": math.inf, "err": None, "ok": False}
    err = 0.0 if want is None else ((out.float() - want).norm() / want.norm()).item()
    ok = math.isfinite(err) and err <= TOL and bool(torch.isfinite(out).all())
    return {"config": cfg, "us": us if ok else math.inf, "err": err, "ok": ok}


def cfg_text(cfg: dict) -> str:
    return f"BLOCK_M={cfg['BLOCK_M']} up {tile_of(cfg, 1)} down {tile_of(cfg, 2)}"


def sweep_tokens(experts: Experts, tokens: int, deadline: float, min_gain: float) -> dict:
    """Every planned candidate at ``tokens``; the best one other than the defaults, and whether it wins."""
    shape = experts.shape
    inputs = experts.inputs(tokens)
    key = fp8_moe.grouped_config_key(shape.experts, shape.hidden, shape.inter, shape.pairs, tokens * shape.pairs)
    default = defaults_at(shape, tokens)
    want = experts.run(*inputs, default).float()
    base = measure(experts, inputs, default, None, tokens)
    print(f"{key} T={tokens} defaults {cfg_text(default)}: {base['us']:.1f} us", flush=True)
    rows, best = [base], None
    for bm, ups, downs in plan(shape, tokens):
        up_best = None
        for gemm, cands in ((1, ups), (2, downs[1:])):  # downs[0] with the best up: timed among the ups
            for tile in cands:
                if time.time() > deadline:
                    break
                up, down = (tile, downs[0]) if gemm == 1 else (tile_of(up_best["config"], 1), tile)
                cfg = {"BLOCK_M": bm, **tile_keys(up, 1), **tile_keys(down, 2)}
                row = base if cfg == default else measure(experts, inputs, cfg, want, tokens)
                err = "-" if row["err"] is None else f"{row['err']:.1e}"
                print(f"  T={tokens} {cfg_text(cfg)}: {row['us']:.1f} us, err {err}{'' if row['ok'] else ' REJECTED'}",
                      flush=True)
                if row is not base:
                    rows.append(row)
                    best = row if best is None or row["us"] < best["us"] else best
                if gemm == 1 and (up_best is None or row["us"] < up_best["us"]):
                    up_best = row
            if up_best is None:  # the deadline came first
                break
    result = {"tokens": tokens, "key": key, "default": default, "default_us": base["us"], "best": None,
              "best_us": math.inf, "speedup": 0.0, "best_err": None, "entry": None, "rows": rows,
              "complete": time.time() <= deadline}
    if best is None or not best["ok"]:
        print(f"{key} T={tokens}: no candidate ran correctly in time; no entry", flush=True)
        return result
    again = measure(experts, inputs, default, want, tokens), measure(experts, inputs, best["config"], want, tokens)
    default_us, best_us = min(base["us"], again[0]["us"]), min(best["us"], again[1]["us"])  # side by side, again
    entry = best["config"] if best_us < (1 - min_gain) * default_us else None
    print(f"{key} T={tokens}: best {cfg_text(best['config'])} {best_us:.1f} us vs the defaults {default_us:.1f} us "
          f"({default_us / best_us:.3f}x, err {best['err']:.1e}) -> "
          f"{'table entry' if entry else 'no entry (the defaults stay)'}", flush=True)
    return {**result, "default_us": default_us, "best": best["config"], "best_us": best_us,
            "speedup": default_us / best_us, "best_err": best["err"], "entry": entry}


def write_table(entry: dict, path: Path, command: str, device: str) -> None:
    """Merge ``entry`` into the table at ``path``: every other kernel and every other key kept."""
    table = json.loads(path.read_text()) if path.exists() else {}
    comment = (f"bench/fp8_moe_grouped_sweep.py on {device}: `{command}`; keys e{{E}}_h{{H}}_i{{I}}_k{{slots}}_r{{rows "
               "per expert, up to 2^i}; a key only where > 3% faster than the defaults")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(merge(table, {fp8_moe.GROUPED_KERNEL: entry}, comment, by_key=True)))
    os.replace(tmp, path)
    print(f"merged {sorted(entry)} into {path}", flush=True)


def model_shape(model: str) -> MoeShape:
    if model == "qwen" or SMOKE:
        return QWEN
    found = moe_shapes(model)
    if len(found) != 1:
        raise SystemExit(f"fp8_moe_grouped_sweep: {model} has {len(found)} MoE shapes ({found}); nothing to sweep")
    return found[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    ap.add_argument("--model", default="qwen", choices=MODELS)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: the interpreter)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="--tiny --device cpu")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--deadline-s", type=float, default=110.0, help="stop timing candidates after this; write anyway")
    ap.add_argument("--min-gain", type=float, default=0.03, help="a winner must beat the defaults by this")
    ap.add_argument("--workers", type=int, default=1 if SMOKE else min(12, os.cpu_count() or 1))
    ap.add_argument("--write", action="store_true", help="merge the entries into --table")
    ap.add_argument("--table", type=Path, help="the table --write merges into (default: the model's plugin's tuning/sm_90.json; "
                                               "off the GPU a copy of it in --out)")
    ap.add_argument("--merge", type=Path, help="merge this fp8_moe_grouped_table.json into --table; no sweep")
    args = ap.parse_args()
    if args.tiny != (args.device == "cpu") and not args.smoke:
        ap.error("--tiny goes with --device cpu (the real shapes need the GPU)")
    if args.merge:
        entry = json.loads(args.merge.read_text())[fp8_moe.GROUPED_KERNEL]
        info = json.loads(args.merge.with_name("fp8_moe_grouped_sweep.json").read_text())
        if entry:
            write_table(entry, args.table or table_path(PACKAGES[info["model"]], "sm_90"), " ".join(
                ["python bench/fp8_moe_grouped_sweep.py", *info["argv"]]), info["device"])
        return
    if not args.out:
        ap.error("--out or $OUT is required")
    start = time.time()
    deadline = start + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = model_shape(args.model)
    token_counts = [int(t) for t in args.tokens.split(",")]
    import triton

    info = {"device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "model": args.model, "shape": dataclasses.asdict(shape), "block": BLOCK,
            "argv": sys.argv[1:]}
    print(f"torch {torch.__version__}, triton {triton.__version__}, {info['device']}; {args.model}: {shape}; "
          f"tiles print as (BLOCK_N, num_warps, num_stages, GROUP_M)", flush=True)
    if not SMOKE and args.workers > 1:  # at most half the time: what is left compiles when first timed
        compile_in_workers(warm_worker, compile_jobs(shape, token_counts), args.workers, 0.5 * args.deadline_s)
    experts = Experts(shape)
    results = []
    for j, tokens in enumerate(token_counts):  # the time left shared evenly by the token counts still to run
        now = time.time()
        results.append(sweep_tokens(experts, tokens, now + max(0.0, deadline - now) / (len(token_counts) - j),
                                    args.min_gain))
        entry = {r["key"]: r["entry"] for r in results if r["entry"]}
        (out / "fp8_moe_grouped_sweep.json").write_text(json.dumps(
            {**info, "results": results, "table": {fp8_moe.GROUPED_KERNEL: entry}, "elapsed_s": time.time() - start,
             "deadline_hit": time.time() > deadline}, indent=1, default=str))
        (out / "fp8_moe_grouped_table.json").write_text(json.dumps({fp8_moe.GROUPED_KERNEL: entry}, indent=1))
    for r in results:  # the summary: one line per bucket
        best = cfg_text(r["best"]) if r["best"] else "-"
        print(f"winner {r['key']} T={r['tokens']}: {best if r['entry'] else 'the defaults'}; best candidate {best} "
              f"{r['best_us']:.1f} us vs the defaults {r['default_us']:.1f} us ({r['speedup']:.3f}x)", flush=True)
    print(f'"{fp8_moe.GROUPED_KERNEL}" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write and entry:
        path = args.table or table_path(PACKAGES[args.model], "sm_90")
        if SMOKE and args.table is None:  # interpreter timings never reach the package: a copy takes the merge
            path = out / "sm_90.json"
            path.write_text(table_path(PACKAGES[args.model], "sm_90").read_text())
        write_table(entry, path, " ".join(["python bench/fp8_moe_grouped_sweep.py", *sys.argv[1:]]), info["device"])
    elif args.write:
        print("--write: no winner beats the defaults by the margin; the table stays as it is")
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp8_moe_grouped_sweep.json'}")


if __name__ == "__main__":
    main()
