"""Launch-config sweep of the FP8 grouped MoE (``fp8_fused_moe`` grouped path: 64-stream decode and prefill) per rows-per-expert bucket, the whole call timed.

    python bench/fp8_moe_grouped_sweep.py --deadline-s 240           # H200: Qwen3.6 FP8 experts, JSON to $OUT
    python bench/fp8_moe_grouped_sweep.py --model nemotron           # a plugin model's expert shape, fp8 blocks
    python bench/fp8_moe_grouped_sweep.py --merge DIR/fp8_moe_grouped_table.json   # no GPU: merge a GPU run's
                                                                     # entry into that model's plugin's tuning/sm_90.json
    python bench/fp8_moe_grouped_sweep.py --tiny --device cpu --write --out DIR   # CPU interpreter (or --smoke):
                                                                     # tiny shapes, the merge into DIR/sm_90.json

Shape: Qwen3.6-35B-A3B-FP8 (H 2048, I 512, 256 routed experts + the shared one stacked as id 256, ids
[T, 8 + 1] with the shared id last), 128 x 128 block e4m3 weights (``fp8.quantize_blocks``); ``--model M``:
that plugin model's ``FusedMoE`` shape (decode_shapes.py) with the same blocks. One weight copy: every
token count streams far more than the 50 MB L2. Per token count (one per rows-per-expert bucket: 64 = 64
decode streams, up to 16384-token prefill chunks), at each BLOCK_M candidate: the up GEMM's (BLOCK_N1, num_warps1, num_stages1, GROUP_M1)
candidates with the down GEMM at today's tiles, then the down GEMM's with the best up; every run is the
whole ``fp8_fused_moe(..., grouped=True, tiles=cfg)`` call (activation quantization, align, both GEMMs,
the top-k sum), in a CUDA graph of 20 calls up to 4096 tokens (grouped_search), CUDA events over eager calls above.
Each candidate's output is checked against the defaults' (norm ratio, <= 1e-2 and finite, else rejected).
Beside them, same run: the dequant path (experts unpacked, core's bf16 MoE) and the bf16 MoE alone, both
checked against the weight-only reference. A bucket's entry is ``{"variant": "dequant"}`` where the dequant
path beats the fastest grouped launch by more than --min-gain (3%), else the tile winner where it beats the
defaults by that much (the defaults and the winner timed once more, side by side), else none. Candidates compile in
spawned worker processes first (Triton's disk cache). Writes $OUT/fp8_moe_grouped_sweep.json and
$OUT/fp8_moe_grouped_table.json ({"fp8_moe_grouped": {key: cfg}}).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402
from armillary.kernels.triton.fp8_gemm import dequantize_blocks  # noqa: E402
from autotune import table_path  # noqa: E402
from decode_shapes import MODELS, PACKAGES, MoeShape, moe_shapes  # noqa: E402
from grouped_search import (SMEM, Tiles, measure, merge_run, pick_variant, search, summary, sweep_counts,  # noqa: E402
                            time_paths, write_winners)
from skinny_gemm import compile_in_workers  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the interpreter miscomputes bf16
QWEN = MoeShape(experts=257, shared=1, pairs=9, hidden=2048, inter=512, activation="silu", gated=True)
BLOCK = (128, 128)
TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 16384)  # r4 .. r512: one count per bucket
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


SCRIPT = "fp8_moe_grouped_sweep.py"
TILE = Tiles(("BLOCK_N", "num_warps", "num_stages", "GROUP_M"))


def defaults_at(shape: MoeShape, tokens: int, block_m: int | None = None) -> dict:
    """Today's launch (no table) at ``block_m`` rows per tile (None: today's rows for this many pairs)."""
    return fp8_moe.grouped_defaults(tokens * shape.pairs, not SMOKE, block_m, shape.experts)


def fits(block_m: int, tile: tuple) -> bool:
    """A pipeline stage holds a [BM, 128] and a [128, BN] e4m3 tile."""
    return SMOKE or tile[2] * (block_m + tile[0]) * BLOCK[1] <= SMEM


def plan(shape: MoeShape, tokens: int) -> list[tuple[int, list[tuple], list[tuple]]]:
    """(BLOCK_M, up tiles, down tiles) per BLOCK_M candidate, today's tiles first in each list."""
    avg = math.ceil(tokens * shape.pairs / shape.experts)
    bms = next(bms for bound, bms in BLOCK_MS if avg <= bound)
    return TILE.plan(bms, lambda bm: defaults_at(shape, tokens, bm), TILES, fits)


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
    return [(shape, cfg) for cfg in TILE.first_configs([plan(shape, tokens) for tokens in token_counts])]


def sweep_tokens(experts: Experts, tokens: int, deadline: float, min_gain: float) -> dict:
    """Every planned candidate at ``tokens``; the best one other than the defaults, and whether it wins."""
    shape = experts.shape
    inputs = experts.inputs(tokens)
    key = fp8_moe.grouped_config_key(shape.experts, shape.hidden, shape.inter, shape.pairs, tokens * shape.pairs)
    default = defaults_at(shape, tokens)
    run = functools.partial(experts.run, *inputs)
    want = run(default).float()
    base = measure(run, default, None, tokens)
    context = same_run_context(experts, inputs, tokens)
    print(f"{key} T={tokens} defaults {TILE.text(default)}: {base['us']:.1f} us; dequant path "
          f"{context['dequant']['us']:.1f} us, bf16 MoE {context['bf16']['us']:.1f} us", flush=True)
    result = search(run, TILE, plan(shape, tokens), key, tokens, default, want, base, deadline, min_gain)
    return {**result, **pick_variant(result, context["dequant"], min_gain), "context": context}


def same_run_context(experts: Experts, inputs: tuple, tokens: int) -> dict:
    """µs of the dequant path (experts unpacked, core's bf16 MoE) and of the bf16 MoE alone on the unpacked
    experts, each checked against the weight-only reference (activations unquantized, as both compute)."""
    x, w, ids = inputs
    e = experts
    want = ref.fused_moe(x, e.w13, e.s13, e.w2, e.s2, *BLOCK, w, ids, e.shape.activation).float()
    w13, w2 = (dequantize_blocks(q, sc, *BLOCK, x.dtype) for q, sc in ((e.w13, e.s13), (e.w2, e.s2)))
    context = time_paths({"dequant": (lambda: fp8_moe.fp8_fused_moe(x, e.w13, e.s13, e.w2, e.s2, *BLOCK, w, ids,
                                                                    e.shape.activation, grouped="dequant"), want),
                          "bf16": (lambda: bf16_moe.fused_moe(x, w13, w2, w, ids, e.shape.activation), want)}, tokens)
    return context


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
    ap.add_argument("--deadline-s", type=float, default=240.0, help="stop timing candidates after this; write anyway")
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
        merge_run(args.merge, fp8_moe.GROUPED_KERNEL, SCRIPT,
                  lambda info: args.table or table_path(PACKAGES[info.get("model", "qwen")], "sm_90"))
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
    results, entry = sweep_counts(lambda tokens, until: sweep_tokens(experts, tokens, until, args.min_gain),
                                  token_counts, deadline, out, "fp8_moe_grouped", fp8_moe.GROUPED_KERNEL, info, start)
    for r in results:  # the summary: one line per bucket
        print(summary(r, TILE), flush=True)
    print(f'"{fp8_moe.GROUPED_KERNEL}" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write:
        write_winners(entry, fp8_moe.GROUPED_KERNEL, SCRIPT, args.table, table_path(PACKAGES[args.model], "sm_90"),
                      out, SMOKE, sys.argv[1:], info["device"])
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp8_moe_grouped_sweep.json'}")


if __name__ == "__main__":
    main()
