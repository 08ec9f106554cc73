"""Sweep the grouped fused-MoE GEMM tiles at one plugin model's expert shape, per rows-per-expert bucket.

    python bench/moe_grouped_sweep.py --out DIR --model nemotron   # GPU: DIR/moe_grouped_sweep.json
    python bench/moe_grouped_sweep.py --out DIR --model glm --smoke  # CPU interpreter: the plumbing only

The grouped path (``fused_moe(path="grouped")``) serves every MoE call past the decode kernels: 64
decode streams (a few rows per expert), 2K chunks and 16K prefills (hundreds). Its tiles come from the
``fused_moe`` table keyed by ``grouped_config_key`` (average rows per expert: r8 / r32 / r128 / r512);
without an entry every model runs the 64-row defaults. Per bucket this times the whole MoE (both
GEMMs and the top-k sum) at a token count that lands in it: each BLOCK_M's GEMM 1 candidates with
GEMM 2 at its first candidate, then GEMM 2's with the best GEMM 1, against the defaults in the same
run. A bucket gets an entry only when its best config beats the defaults by more than 3%; the
result names the plugin package whose ``tuning/`` the entries belong in (``bench/autotune.py
--model M`` merges them). Candidates compile in parallel worker processes first (Triton's disk cache).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton.moe import GROUPED_DEFAULTS, fused_moe, grouped_config_key  # noqa: E402
from decode_shapes import MODELS, PACKAGES, MoeShape, moe_shapes  # noqa: E402
from moe_kernels import bench_ms  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
WIN = 0.97  # an entry only for a config under 97% of the defaults' time
# bucket -> (tokens that land in it for a Nemotron / GLM / Gemma 4 / Qwen shape, BLOCK_M candidates)
BUCKETS = {"r8": (64, (16, 32, 64)), "r128": (2048, (64, 128)), "r512": (16384, (64, 128))}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M, GEMM 1 then GEMM 2 (the first is each one's baseline)
G1 = {
    16: [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3), (64, 256, 4, 3)],
    32: [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3)],
    64: [(128, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 3), (256, 64, 8, 3), (128, 128, 8, 3)],
    128: [(128, 64, 8, 4), (64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 8, 3)],
}
G2 = {
    16: [(64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3)],
    32: [(64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4), (128, 128, 8, 3)],
    64: [(128, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3)],
    128: [(128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 4)],
}
if SMOKE:
    BUCKETS = {"r8": (3, (16,)), "r32": (40, (16, 32))}
    G1 = G2 = {16: [(16, 16, 2, 1), (32, 16, 2, 1)], 32: [(16, 16, 2, 1)]}


def grouped_cfg(block_m: int, g1: tuple, g2: tuple) -> dict:
    return {"BLOCK_M": block_m, "GROUP_M": 8, "BLOCK_N1": g1[0], "BLOCK_K1": g1[1], "num_warps1": g1[2],
            "num_stages1": g1[3], "BLOCK_N2": g2[0], "BLOCK_K2": g2[1], "num_warps2": g2[2], "num_stages2": g2[3]}


def model_shape(model: str) -> MoeShape:
    if SMOKE:
        return MoeShape(experts=7, shared=1, pairs=3, hidden=48, inter=24, activation="silu", gated=True)
    found = moe_shapes(model)
    if len(found) != 1:
        raise SystemExit(f"moe_grouped_sweep: {model} has {len(found)} MoE shapes ({found}); nothing to sweep")
    return found[0]


class Experts:
    """Random experts of one shape (shared ones stacked last, as ``FusedMoE`` holds them) and routed inputs."""

    def __init__(self, shape: MoeShape, empty: bool = False) -> None:
        self.shape = shape
        rows = 2 * shape.inter if shape.gated else shape.inter
        make = torch.empty if empty else torch.randn
        self.w13 = make(shape.experts, rows, shape.hidden, device=DEVICE, dtype=DTYPE) * shape.hidden**-0.5
        self.w2 = make(shape.experts, shape.hidden, shape.inter, device=DEVICE, dtype=DTYPE) * shape.inter**-0.5

    def inputs(self, tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], weights [T, pairs] float32, ids [T, pairs] int32 (distinct routed ids, then the shared)."""
        s, g = self.shape, torch.Generator().manual_seed(seed)
        routed = s.experts - s.shared
        ids = torch.rand(tokens, routed, generator=g).argsort(dim=1)[:, : s.pairs - s.shared]  # [T, k] distinct
        ids = torch.cat((ids, torch.arange(routed, s.experts).expand(tokens, s.shared)), dim=1)
        weights = torch.rand(tokens, s.pairs, generator=g)
        x = torch.randn(tokens, s.hidden, generator=g)
        return x.to(DEVICE, DTYPE), weights.to(DEVICE), ids.to(DEVICE, torch.int32)

    def run(self, x, weights, ids, cfg: dict | None):
        return fused_moe(x, self.w13, self.w2, weights, ids, self.shape.activation, path="grouped", config=cfg)


def candidates() -> list[tuple[int, dict]]:
    """(tokens, config) covering every kernel variant the sweep may time (each GEMM's candidates compile apart)."""
    jobs = []
    for tokens, block_ms in BUCKETS.values():
        for bm in block_ms:
            jobs += [(tokens, grouped_cfg(bm, g1, G2[bm][0])) for g1 in G1[bm]]
            jobs += [(tokens, grouped_cfg(bm, G1[bm][0], g2)) for g2 in G2[bm][1:]]
    return jobs


def _compile(args: tuple[MoeShape, list[tuple[int, dict]]]) -> int:
    shape, jobs = args
    experts, done = Experts(shape, empty=True), 0
    for tokens, cfg in jobs:
        try:
            experts.run(*experts.inputs(tokens), cfg)
            done += 1
        except Exception:  # too much shared memory and the like: the timed run reports it
            pass
    return done


def warm_compile(shape: MoeShape, workers: int) -> None:
    if workers <= 1:
        return
    import multiprocessing as mp

    jobs, start = candidates(), time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, [(shape, jobs[i::workers]) for i in range(workers)]))
    print(f"compiled {done}/{len(jobs)} candidate launches in {workers} processes, {time.time() - start:.0f} s", flush=True)


def timed(fn) -> float:
    try:
        return bench_ms(fn)
    except Exception as e:  # a config over the shared memory: out of the running
        print(f"  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("inf")


def sweep_bucket(experts: Experts, bucket: str, tokens: int, block_ms: tuple[int, ...]) -> dict:
    x, weights, ids = experts.inputs(tokens)
    key = grouped_config_key(ids.numel(), experts.shape.experts)
    default_ms = timed(lambda: experts.run(x, weights, ids, None))
    best_ms, best_cfg = float("inf"), None
    for bm in block_ms:
        g1_times = [(timed(lambda: experts.run(x, weights, ids, grouped_cfg(bm, g1, G2[bm][0]))), g1) for g1 in G1[bm]]
        g1 = min(g1_times)[1]
        g2_times = [(timed(lambda: experts.run(x, weights, ids, grouped_cfg(bm, g1, g2))), g2) for g2 in G2[bm]]
        ms, g2 = min(g2_times)
        print(f"{key} T={tokens} BLOCK_M={bm}: GEMM 1 {g1_times}; GEMM 2 {g2_times}", flush=True)
        if ms < best_ms:
            best_ms, best_cfg = ms, grouped_cfg(bm, g1, g2)
    err = None
    if best_cfg is not None:  # the winner must compute what the defaults do
        ref = experts.run(x, weights, ids, None).float()
        err = ((experts.run(x, weights, ids, best_cfg).float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            print(f"{key}: best config off by {err:.2e} from the defaults' output: rejected", flush=True)
            best_ms, best_cfg = float("inf"), None
    print(f"{key} T={tokens}: best {best_ms:.4f} ms vs the defaults {default_ms:.4f} ms ({best_ms / default_ms:.3f}x) "
          f"{best_cfg}", flush=True)
    return {"bucket": key, "wanted": bucket, "tokens": tokens, "default_ms": default_ms, "best_ms": best_ms,
            "config": best_cfg, "rel_err_vs_defaults": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="nemotron", choices=MODELS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=1 if SMOKE else 12)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    package = PACKAGES[args.model]
    tuning.use_packages((package,))  # the defaults the served model reads today
    shape = model_shape(args.model)
    print(f"{args.model}: {shape}", flush=True)
    warm_compile(shape, args.workers)
    experts = Experts(shape)
    rows = [sweep_bucket(experts, bucket, tokens, block_ms) for bucket, (tokens, block_ms) in BUCKETS.items()]
    table = {r["bucket"]: r["config"] for r in rows if r["config"] is not None and r["best_ms"] < WIN * r["default_ms"]}
    result = {"model": args.model, "package": package, "device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(),
              "defaults": dict(GROUPED_DEFAULTS), "rows": rows, "table": table}
    (args.out / "moe_grouped_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"entries for {package}: {sorted(table) or 'none (the defaults win)'} -> {args.out / 'moe_grouped_sweep.json'}")


if __name__ == "__main__":
    main()
