"""Launch-config sweep of the NVFP4 grouped MoE (``fp4_fused_moe`` grouped path: 64-stream decode and prefill) per rows-per-expert bucket at the Qwen3.6-35B-A3B expert shape, the whole call timed.

    python bench/fp4_moe_grouped_sweep.py --out DIR                  # H200: JSON to DIR (default $OUT)
    python bench/fp4_moe_grouped_sweep.py --out DIR --write          # also merge the winners into the Qwen plugin's tuning/sm_90.json
    python bench/fp4_moe_grouped_sweep.py --merge DIR/fp4_moe_grouped_table.json   # no GPU: merge a GPU run's entry
    python bench/fp4_moe_grouped_sweep.py --tiny --device cpu --out DIR [--write --table T]   # CPU interpreter smoke
                                                                     # (--smoke: the same, as autotune --smoke runs it)

Shape and weights: fp4_moe_gemv_sweep's (``decode_shapes.moe_shapes("qwen")``: H 2048, I 512, 256 routed
experts + the shared one as id 256, ids [T, 8 + 1] with the shared id last; NVFP4 from
``armillary.kernels.fp4.quantize_nvfp4`` with row global scales). One weight copy: every token count streams
far more than the 50 MB L2. Per token count (64: 64 decode streams, 2048 and 16384: prefill chunks), at each
BLOCK_M candidate: the up GEMM's (BLOCK_N1, BLOCK_K1, num_warps1, num_stages1) candidates with the down GEMM
at today's tiles, then the down GEMM's with the best up; every run is the whole ``fp4_fused_moe(...,
grouped=True, tiles=cfg)`` call (align, both GEMMs, the activation, the top-k sum), timed as
fp8_moe_grouped_sweep times it (``time_us``: a CUDA graph of 20 calls up to 4096 tokens, CUDA events over
eager calls above) and checked by its ``measure`` against the defaults' output (norm ratio <= 1e-2 and
finite, else rejected). The defaults' output is checked against ``armillary.kernels.fp4.fused_moe``, and the
dequant path (experts unpacked whole, core's bf16 MoE: the ``fp4_moe`` entry's ``dequant_min_pairs``) and
the bf16 MoE alone on the dequantized experts are timed beside them, same run. A bucket's winner enters the
table only when it beats the defaults by more than --min-gain (3%); the defaults and the winner are timed
once more, side by side, for the final figure. Candidates compile in spawned worker processes first
(Triton's disk cache) for at most half of --deadline-s. Writes $OUT/fp4_moe_grouped_sweep.json and
$OUT/fp4_moe_grouped_table.json ({"fp4_moe_grouped": {key: cfg}}).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # autotune --smoke: read as --tiny --device cpu by the sweeps imported below
    sys.argv += ["--tiny", "--device", "cpu"]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# --device cpu: fp4_skinny_sweep (through fp4_moe_gemv_sweep) sets TRITON_INTERPRET before triton loads
from fp4_moe_gemv_sweep import CPU, DEVICE, DTYPE, EXPERTS, HIDDEN, INTER, SLOTS, TINY, routing, weights  # noqa: E402

import torch  # noqa: E402

from autotune import merge, render, table_path  # noqa: E402
from decode_shapes import PACKAGES  # noqa: E402
from fp8_moe_grouped_sweep import SMEM, measure, time_us  # noqa: E402
from skinny_gemm import compile_in_workers  # noqa: E402

from armillary.kernels import fp4 as ref  # noqa: E402
from armillary.kernels.triton import fp4_moe  # noqa: E402
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402

PACKAGE = PACKAGES["qwen"]
TOKENS = (64, 2048, 16384)
# BLOCK_M candidates by average rows per expert (the first bucket with avg <= the bound): a weight tile is
# unpacked once per row block, so larger blocks pay it less often where experts have the rows
BLOCK_MS = ((8, (16, 32)), (64, (16, 32, 64)), (256, (32, 64, 128)), (1 << 30, (64, 128)))
# per GEMM: (BLOCK_N, BLOCK_K, num_warps, num_stages); today's tiles at each BLOCK_M are timed first
TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 4, 3),
         (128, 128, 8, 3), (128, 256, 8, 2), (256, 64, 8, 3), (256, 128, 8, 3)]
if TINY:
    TOKENS = (3, 20)  # 9 and 60 pairs over 6 experts: r2 and r16
    BLOCK_MS = ((4, (16,)), (1 << 30, (16, 32)))
    TILES = [(16, 32, 4, 1), (64, 64, 2, 1)]  # K tiles past H = 80 and I = 48, N tiles past 2I and H
KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def tile_keys(tile: tuple, gemm: int) -> dict:
    return {f"{key}{gemm}": value for key, value in zip(KEYS, tile)}


def tile_of(cfg: dict, gemm: int) -> tuple:
    return tuple(cfg[f"{key}{gemm}"] for key in KEYS)


def defaults_at(tokens: int, block_m: int | None = None) -> dict:
    """Today's launch (no table) at ``block_m`` rows per tile (None: today's rows for this many pairs)."""
    return fp4_moe.grouped_defaults(tokens * SLOTS, not CPU, block_m)


def fits(block_m: int, tile: tuple) -> bool:
    """A pipeline stage holds a [BM, BK] x-dtype tile, the [BN, BK / 2] packed codes and [BN, BK / 16] scales."""
    bn, bk, _, stages = tile
    return CPU or stages * (block_m * bk * DTYPE.itemsize + bn * bk // 2 + bn * bk // 16) <= SMEM


def plan(tokens: int) -> list[tuple[int, list[tuple], list[tuple]]]:
    """(BLOCK_M, up tiles, down tiles) per BLOCK_M candidate, today's tiles first in each list."""
    avg = math.ceil(tokens * SLOTS / EXPERTS)
    out = []
    for bm in next(bms for bound, bms in BLOCK_MS if avg <= bound):
        base = defaults_at(tokens, bm)
        ups = [tile_of(base, 1)] + [t for t in TILES if t != tile_of(base, 1) and fits(bm, t)]
        downs = [tile_of(base, 2)] + [t for t in TILES if t != tile_of(base, 2) and fits(bm, t)]
        out.append((bm, ups, downs))
    return out


class Experts:
    """One copy of the NVFP4 experts (fp4_moe_gemv_sweep's ``weights``) and their bf16 dequantization; ``run``
    is what fp8_moe_grouped_sweep's ``measure`` times."""

    def __init__(self, seed: int = 1) -> None:
        copy = weights(seed)
        self.fp4 = tuple(copy[name] for name in ("w13", "s13", "g13", "w2", "s2", "g2"))
        self.bf16 = (copy["w13b"], copy["w2b"])

    @staticmethod
    def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], routing weights [T, k + 1] fp32, ids [T, k + 1] int32 (the shared id last)."""
        route = routing(tokens, seed=tokens)
        return route["x"], route["w"], route["ids"]

    def run(self, x, weights, ids, cfg: dict) -> torch.Tensor:
        return fp4_moe.fp4_fused_moe(x, *self.fp4, weights, ids, "silu", grouped=True, tiles=cfg)


def warm_worker(cfg: dict) -> bool:
    """Compile one config's two GEMMs by one call on two empty experts of the real shape (the same
    specialisation: strides and sizes as the timed calls have; only the grid differs)."""
    try:
        dev, e4m3 = torch.device(DEVICE), torch.float8_e4m3fn
        w13 = torch.zeros(2, 2 * INTER, HIDDEN // 2, device=dev, dtype=torch.uint8)
        s13 = torch.ones(2, 2 * INTER, HIDDEN // 16, device=dev).to(e4m3)
        w2 = torch.zeros(2, HIDDEN, INTER // 2, device=dev, dtype=torch.uint8)
        s2 = torch.ones(2, HIDDEN, INTER // 16, device=dev).to(e4m3)
        ids = (torch.arange(16 * SLOTS, device=dev, dtype=torch.int32) % 2).view(16, SLOTS)
        fp4_moe.fp4_fused_moe(torch.zeros(16, HIDDEN, device=dev, dtype=DTYPE), w13, s13,
                              torch.ones(2, 2 * INTER, device=dev), w2, s2, torch.ones(2, HIDDEN, device=dev),
                              torch.ones(16, SLOTS, device=dev), ids, "silu", grouped=True, tiles=cfg)
        torch.cuda.synchronize()
        return True
    except Exception as e:  # the timed run reports it
        print(f"warm {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return False


def compile_jobs(token_counts: list[int]) -> list[dict]:
    """Every (BLOCK_M, up, down) the sweep may time first: up candidates with today's down, and the reverse."""
    seen, jobs = set(), []
    for tokens in token_counts:
        for bm, ups, downs in plan(tokens):
            for up, down in [(u, downs[0]) for u in ups] + [(ups[0], d) for d in downs[1:]]:
                if (bm, up, down) not in seen:
                    seen.add((bm, up, down))
                    jobs.append({"BLOCK_M": bm, **tile_keys(up, 1), **tile_keys(down, 2)})
    return jobs


def cfg_text(cfg: dict) -> str:
    return f"BLOCK_M={cfg['BLOCK_M']} up {tile_of(cfg, 1)} down {tile_of(cfg, 2)}"


def _ratio(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want).norm() / want.norm()).item()


def same_run_context(experts: Experts, inputs: tuple, want: torch.Tensor, tokens: int) -> dict:
    """µs and error against the defaults of the dequant path and of the bf16 MoE alone (inf where one fails)."""
    x, w, ids = inputs
    calls = {"dequant": lambda: fp4_moe.fp4_fused_moe(x, *experts.fp4, w, ids, "silu", grouped="dequant"),
             "bf16": lambda: bf16_moe.fused_moe(x, *experts.bf16, w, ids, "silu")}
    context = {}
    for name, fn in calls.items():
        try:
            us, out = time_us(fn, tokens)
            context[name] = {"us": us, "err": _ratio(out, want)}
        except Exception as e:  # context only: the sweep goes on
            context[name] = {"us": math.inf, "err": None, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    return context


def sweep_tokens(experts: Experts, tokens: int, deadline: float, min_gain: float) -> dict:
    """Every planned candidate at ``tokens``; the best one other than the defaults, and whether it wins."""
    inputs = experts.inputs(tokens)
    key = fp4_moe.grouped_config_key(EXPERTS, HIDDEN, INTER, SLOTS, tokens * SLOTS)
    default = defaults_at(tokens)
    want = experts.run(*inputs, default).float()
    reference_err = _ratio(ref.fused_moe(inputs[0], *experts.fp4, inputs[1], inputs[2], "silu"), want)
    base = measure(experts, inputs, default, None, tokens)
    context = same_run_context(experts, inputs, want, tokens)
    print(f"{key} T={tokens} defaults {cfg_text(default)}: {base['us']:.1f} us (err vs the reference "
          f"{reference_err:.1e}); dequant path {context['dequant']['us']:.1f} us, bf16 MoE {context['bf16']['us']:.1f} us",
          flush=True)
    rows, best = [base], None
    for bm, ups, downs in plan(tokens):
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
    result = {"tokens": tokens, "key": key, "default": default, "default_us": base["us"],
              "reference_err": reference_err, "context": context, "best": None, "best_us": math.inf, "speedup": 0.0,
              "best_err": None, "entry": None, "rows": rows, "complete": time.time() <= deadline}
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
    comment = (f"bench/fp4_moe_grouped_sweep.py on {device}: `{command}`; keys e{{E}}_h{{H}}_i{{I}}_k{{slots}}_r{{rows "
               "per expert, up to 2^i}; a key only where > 3% faster than the defaults")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(merge(table, {fp4_moe.GROUPED_KERNEL: entry}, comment, by_key=True)))
    os.replace(tmp, path)
    print(f"merged {sorted(entry)} into {path}", flush=True)


def merge_result(table_file: Path, table: Path) -> None:
    """--merge: a GPU run's entry into ``table``, stamped with that run's device and command."""
    entry = json.loads(table_file.read_text())[fp4_moe.GROUPED_KERNEL]
    run = table_file.with_name("fp4_moe_grouped_sweep.json")
    info = json.loads(run.read_text()) if run.exists() else {}
    if not entry:
        print(f"{table_file}: an empty entry; the table stays as it is")
        return
    write_table(entry, table, " ".join(["python bench/fp4_moe_grouped_sweep.py", *info.get("argv", ["?"])]),
                info.get("device", "unknown GPU"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the Triton interpreter")
    ap.add_argument("--tiny", action="store_true", help="tiny experts, two tiles a GEMM: the plumbing only")
    ap.add_argument("--smoke", action="store_true", help="--tiny --device cpu (autotune --smoke)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--deadline-s", type=float, default=240.0, help="stop timing candidates after this (the compile "
                    "warm-up takes at most half); write anyway")
    ap.add_argument("--min-gain", type=float, default=0.03, help="a winner must beat the defaults by this")
    ap.add_argument("--workers", type=int, default=1 if CPU else min(12, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--write", action="store_true", help="merge the entry into --table")
    ap.add_argument("--table", type=Path, help="the table --write / --merge merge into (default: the Qwen plugin's "
                                               "tuning/sm_90.json; off the GPU --write makes a copy of it in --out)")
    ap.add_argument("--merge", type=Path, help="merge this fp4_moe_grouped_table.json into --table; no sweep")
    args = ap.parse_args()
    if args.merge:
        merge_result(args.merge, args.table or table_path(PACKAGE, "sm_90"))
        return
    if CPU and not TINY:
        ap.error("--device cpu goes with --tiny (the interpreter cannot run the real shapes)")
    if not args.out:
        ap.error("--out or $OUT is required")
    start = time.time()
    deadline = start + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    token_counts = [int(t) for t in args.tokens.split(",")]
    import triton

    info = {"device": "cpu-interpreter" if CPU else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "model": "qwen",
            "shape": {"experts": EXPERTS, "slots": SLOTS, "hidden": HIDDEN, "inter": INTER}, "argv": sys.argv[1:]}
    print(f"torch {torch.__version__}, triton {triton.__version__}, {info['device']}; shape {info['shape']}; tiles "
          "print as (BLOCK_N, BLOCK_K, num_warps, num_stages)", flush=True)
    if not CPU and args.workers > 1:  # at most half the time: what is left compiles when first timed
        compile_in_workers(warm_worker, compile_jobs(token_counts), args.workers, 0.5 * args.deadline_s)
    experts = Experts()
    results, entry = [], {}
    for j, tokens in enumerate(token_counts):  # the time left shared evenly by the token counts still to run
        now = time.time()
        results.append(sweep_tokens(experts, tokens, now + max(0.0, deadline - now) / (len(token_counts) - j),
                                    args.min_gain))
        entry = {r["key"]: r["entry"] for r in results if r["entry"]}
        (out / "fp4_moe_grouped_sweep.json").write_text(json.dumps(
            {**info, "results": results, "table": {fp4_moe.GROUPED_KERNEL: entry}, "elapsed_s": time.time() - start,
             "deadline_hit": time.time() > deadline}, indent=1, default=str))
        (out / "fp4_moe_grouped_table.json").write_text(json.dumps({fp4_moe.GROUPED_KERNEL: entry}, indent=1))
    for r in results:  # the summary: one line per bucket
        best = cfg_text(r["best"]) if r["best"] else "-"
        print(f"winner {r['key']} T={r['tokens']}: {best if r['entry'] else 'the defaults'}; best candidate {best} "
              f"{r['best_us']:.1f} us vs the defaults {r['default_us']:.1f} us ({r['speedup']:.3f}x); dequant path "
              f"{r['context']['dequant']['us']:.1f} us, bf16 MoE {r['context']['bf16']['us']:.1f} us", flush=True)
    print(f'"{fp4_moe.GROUPED_KERNEL}" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write and entry:
        path = args.table or table_path(PACKAGE, "sm_90")
        if CPU and args.table is None:  # interpreter timings never reach the package: a copy takes the merge
            path = out / "sm_90.json"
            path.write_text(table_path(PACKAGE, "sm_90").read_text())
        write_table(entry, path, " ".join(["python bench/fp4_moe_grouped_sweep.py", *sys.argv[1:]]), info["device"])
    elif args.write:
        print("--write: no winner beats the defaults by the margin; the table stays as it is")
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp4_moe_grouped_sweep.json'}")


if __name__ == "__main__":
    main()
