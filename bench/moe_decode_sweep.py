"""Sweep of the MoE decode kernels' launch configs at 1-8 tokens, timed in CUDA graphs without L2 reuse.

Each timed graph runs the MoE ``ROTATE`` times on disjoint expert sets (like consecutive layers), so the
figures are DRAM-bound as in a real decode step. Prints µs per call and TB/s over the experts' bytes,
and the best config per token count as the JSON entry for ``core/kernels/tuning/sm_90.json``.

    python bench/moe_decode_sweep.py --out DIR
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import SHAPES, Moe, bench_ms, decode_cfg, decode_key, warm_compile  # noqa: E402

ROTATE = 8
UP = [(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (2, 3, 4))
      if n * k <= 16384]
DOWN = [(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4), (2, 3, 4))
        if n * k <= 16384]


def routed_sets(moe: Moe, tokens: int) -> list:
    """ROTATE inputs whose experts do not overlap (ids drawn from disjoint ranges of the 256)."""
    out = []
    per = moe.shape.experts // ROTATE
    for r in range(ROTATE):
        x, w, _ = moe.inputs(tokens, seed=r + 1)
        g = torch.Generator().manual_seed(r)
        ids = torch.stack([torch.randperm(per, generator=g)[: moe.shape.top_k] + r * per for _ in range(tokens)])
        out.append((x, w, ids.to(device="cuda", dtype=torch.int32)))
    return out


def graph_us(fn) -> float:
    """µs per MoE call of fn (ROTATE calls), replayed in a CUDA graph."""
    return bench_ms(fn, graph=True) * 1e3 / ROTATE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4,8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    moe = Moe(SHAPES["qwen3.6"])
    token_counts = [int(t) for t in args.tokens.split(",")]
    jobs = [("qwen3.6", "decode", t, decode_cfg(u, DOWN[0])) for t in token_counts for u in UP]
    jobs += [("qwen3.6", "decode", t, decode_cfg(UP[0], d)) for t in token_counts for d in DOWN]
    warm_compile(8, jobs)
    results = {}
    per_expert = (moe.w13[0].numel() + moe.w2[0].numel()) * moe.w13.element_size()
    for tokens in token_counts:
        sets = routed_sets(moe, tokens)
        nbytes = len(torch.unique(sets[0][2])) * per_expert

        def timed(cfg):
            try:
                return graph_us(lambda: [moe.run(x, w, i, "decode", cfg) for x, w, i in sets])
            except Exception as e:  # a config over the resource limits
                print(f"  T={tokens} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return float("inf")

        default = timed(None)
        ups = sorted((timed(decode_cfg(u, DOWN[0])), u) for u in UP)
        best_up = ups[0][1]
        downs = sorted((timed(decode_cfg(best_up, d)), d) for d in DOWN)
        best = decode_cfg(best_up, downs[0][1])
        best_us = downs[0][0]
        grouped = graph_us(lambda: [moe.run(x, w, i, "grouped") for x, w, i in sets])
        results[tokens] = {"default_us": default, "best_us": best_us, "grouped_us": grouped,
                           "best_tb_s": nbytes / best_us / 1e6, "config": best,
                           "top_up": ups[:5], "top_down": downs[:5], "key": decode_key(tokens * moe.shape.top_k)}
        print(f"T={tokens}: default {default:.1f} us, best {best_us:.1f} us ({nbytes / best_us / 1e6:.2f} TB/s), "
              f"grouped {grouped:.1f} us; {json.dumps(best)}", flush=True)
        print(f"  top up {ups[:5]}\n  top down {downs[:5]}", flush=True)
    Path(args.out, "moe_decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
