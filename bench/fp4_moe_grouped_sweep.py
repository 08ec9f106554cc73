"""Launch-config sweep of the NVFP4 grouped MoE (``fp4_fused_moe`` grouped path: 64-stream decode and prefill) per rows-per-expert bucket at the Qwen3.6-35B-A3B expert shape, the whole call timed.

    python bench/fp4_moe_grouped_sweep.py --out DIR                  # H200: JSON to DIR (default $OUT)
    python bench/fp4_moe_grouped_sweep.py --out DIR --write          # also merge the winners into the Qwen plugin's tuning/sm_90.json
    python bench/fp4_moe_grouped_sweep.py --merge DIR/fp4_moe_grouped_table.json   # no GPU: merge a GPU run's entry
    python bench/fp4_moe_grouped_sweep.py --tiny --device cpu --out DIR [--write --table T]   # CPU interpreter smoke
                                                                     # (--smoke: the same, as autotune --smoke runs it)

Shape and weights: fp4_moe_gemv_sweep's (``decode_shapes.moe_shapes("qwen")``: H 2048, I 512, 256 routed
experts + the shared one as id 256, ids [T, 8 + 1] with the shared id last; NVFP4 from
``armillary.kernels.fp4.quantize_nvfp4`` with row global scales). One weight copy: every token count streams
far more than the 50 MB L2. Per token count (one per rows-per-expert bucket: 64 = 64 decode streams, up to
16384-token prefill chunks), at each BLOCK_M candidate: the up GEMM's (BLOCK_N1, BLOCK_K1, num_warps1,
num_stages1) candidates with the down GEMM at today's tiles, then the down GEMM's with the best up; every run
is the whole ``fp4_fused_moe(..., grouped=True, tiles=cfg)`` call (align, both GEMMs, the activation, the top-k
sum), timed and checked by grouped_search (a CUDA graph of 20 calls up to 4096 tokens, CUDA events over eager
calls above; norm ratio to the defaults' output <= 1e-2 and finite, else rejected). The defaults' output is
checked against ``armillary.kernels.fp4.fused_moe``; the dequant path (experts unpacked whole, core's bf16 MoE)
and the bf16 MoE alone on the dequantized experts are timed beside them, same run. A bucket's entry is
``{"variant": "dequant"}`` where the dequant path beats the fastest grouped launch by more than --min-gain
(3%), else the tile winner where it beats the defaults by that much (timed once more side by side), else none.
Candidates compile in spawned worker processes first (Triton's disk cache) for at most half of --deadline-s.
Writes $OUT/fp4_moe_grouped_sweep.json and $OUT/fp4_moe_grouped_table.json ({"fp4_moe_grouped": {key: cfg}}).
"""
from __future__ import annotations

import argparse
import functools
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

from autotune import table_path  # noqa: E402
from decode_shapes import PACKAGES  # noqa: E402
from grouped_search import (SMEM, Tiles, error_ratio, measure, merge_run, pick_variant, search, summary,  # noqa: E402
                            sweep_counts, time_paths, write_winners)
from skinny_gemm import compile_in_workers  # noqa: E402

from armillary.kernels import fp4 as ref  # noqa: E402
from armillary.kernels.triton import fp4_moe  # noqa: E402
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402

PACKAGE = PACKAGES["qwen"]
TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 16384)  # r4 .. r512: one count per bucket
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
SCRIPT = "fp4_moe_grouped_sweep.py"
TILE = Tiles(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))


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
    bms = next(bms for bound, bms in BLOCK_MS if avg <= bound)
    return TILE.plan(bms, lambda bm: defaults_at(tokens, bm), TILES, fits)


class Experts:
    """One copy of the NVFP4 experts (fp4_moe_gemv_sweep's ``weights``) and their bf16 dequantization; ``run``
    is what grouped_search's ``measure`` times."""

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
    return TILE.first_configs([plan(tokens) for tokens in token_counts])


def same_run_context(experts: Experts, inputs: tuple, want: torch.Tensor, tokens: int) -> dict:
    """µs and error against the defaults of the dequant path and of the bf16 MoE alone (inf where one fails)."""
    x, w, ids = inputs
    return time_paths({"dequant": (lambda: fp4_moe.fp4_fused_moe(x, *experts.fp4, w, ids, "silu", grouped="dequant"),
                                   want),
                       "bf16": (lambda: bf16_moe.fused_moe(x, *experts.bf16, w, ids, "silu"), want)}, tokens)


def sweep_tokens(experts: Experts, tokens: int, deadline: float, min_gain: float) -> dict:
    """Every planned candidate at ``tokens``; the best one other than the defaults, and whether it wins."""
    inputs = experts.inputs(tokens)
    key = fp4_moe.grouped_config_key(EXPERTS, HIDDEN, INTER, SLOTS, tokens * SLOTS)
    default = defaults_at(tokens)
    run = functools.partial(experts.run, *inputs)
    want = run(default).float()
    reference_err = error_ratio(ref.fused_moe(inputs[0], *experts.fp4, inputs[1], inputs[2], "silu"), want)
    base = measure(run, default, None, tokens)
    context = same_run_context(experts, inputs, want, tokens)
    print(f"{key} T={tokens} defaults {TILE.text(default)}: {base['us']:.1f} us (err vs the reference "
          f"{reference_err:.1e}); dequant path {context['dequant']['us']:.1f} us, bf16 MoE {context['bf16']['us']:.1f} us",
          flush=True)
    result = search(run, TILE, plan(tokens), key, tokens, default, want, base, deadline, min_gain)
    return {**result, **pick_variant(result, context["dequant"], min_gain), "reference_err": reference_err,
            "context": context}


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
        merge_run(args.merge, fp4_moe.GROUPED_KERNEL, SCRIPT, lambda info: args.table or table_path(PACKAGE, "sm_90"))
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
    results, entry = sweep_counts(lambda tokens, until: sweep_tokens(experts, tokens, until, args.min_gain),
                                  token_counts, deadline, out, "fp4_moe_grouped", fp4_moe.GROUPED_KERNEL, info, start)
    for r in results:  # the summary: one line per bucket
        print(summary(r, TILE), flush=True)
    print(f'"{fp4_moe.GROUPED_KERNEL}" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write:
        write_winners(entry, fp4_moe.GROUPED_KERNEL, SCRIPT, args.table, table_path(PACKAGE, "sm_90"), out, CPU,
                      sys.argv[1:], info["device"])
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp4_moe_grouped_sweep.json'}")


if __name__ == "__main__":
    main()
