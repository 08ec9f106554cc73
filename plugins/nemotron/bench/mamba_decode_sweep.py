"""Mamba-2 fused decode step: the group walk against the row split (split_p x num_warps) per batch size, at Nano's shape, in CUDA graphs.

    python plugins/nemotron/bench/mamba_decode_sweep.py --out DIR           # H200: ~1 min, DIR/mamba_decode_sweep.json
    python plugins/nemotron/bench/mamba_decode_sweep.py --out DIR --smoke   # CPU interpreter, tiny shape: logic only

Nemotron-3 Nano: 64 heads x 64 x 128 fp32 state, 8 groups, conv width 4, bf16 activations. Each
timed graph runs LAYERS launches, each on its own state / window pools (like the 23 Mamba layers
of a step, so no launch finds its state in L2). Every config's output, windows and states are
checked against the group walk (split_p 0) of the same inputs; µs are per launch, TB/s count
the state read and write. Prints the best config per batch and the "mamba_decode" entry for
armillary_nemotron/tuning/sm_90.json (``p64_n128`` ``by_batch``: smallest key >= batch applies).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from armillary.kernels import tuning  # noqa: E402
from armillary_nemotron.ops.mamba.decode import mamba_decode_step  # noqa: E402

tuning.use_packages(("armillary_nemotron",))
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
HEADS, P, GROUPS, N, KW = (4, 8, 2, 16, 4) if SMOKE else (64, 64, 8, 128, 4)
LAYERS = 2 if SMOKE else 23
BATCHES = (1, 2) if SMOKE else (1, 2, 4, 8, 16, 64)
SPLITS = (0, 4, 8) if SMOKE else (0, 8, 16, 32, 64)
WARPS = (1, 2) if SMOKE else (1, 2, 4, 8)


def layer_inputs(batch: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = HEADS * P, HEADS * P + 2 * GROUPS * N
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    proj = rnd(batch, d_inner + conv_dim + HEADS).to(DEVICE, DTYPE)
    z, xbc, dt = proj.split([d_inner, conv_dim, HEADS], dim=-1)
    return dict(xbc=xbc, z=z, dt=dt, w=rnd(conv_dim, KW).to(DEVICE, DTYPE), b=rnd(conv_dim).to(DEVICE, DTYPE),
                conv=rnd(batch, conv_dim, KW - 1).to(DEVICE, DTYPE),
                A_log=torch.log(torch.rand(HEADS, generator=g) + 0.1).to(DEVICE),
                D=rnd(HEADS).to(DEVICE), dt_bias=rnd(HEADS).to(DEVICE), norm_w=rnd(d_inner).to(DEVICE, DTYPE),
                states=(rnd(batch, HEADS, P, N) * 0.3).to(DEVICE), slots=torch.arange(batch, device=DEVICE))


def step(a: dict, conv: torch.Tensor, states: torch.Tensor, cfg: dict) -> torch.Tensor:
    return mamba_decode_step(a["xbc"], a["z"], a["dt"], a["w"], a["b"], conv, a["A_log"], a["D"], a["dt_bias"], 1e-3,
                             a["norm_w"], 1e-5, states, a["slots"], HEADS, P, config=cfg)


def graph_us(fn) -> float:
    """µs per launch of fn (LAYERS launches) replayed in a CUDA graph; smoke: one wall-clock run."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6 / LAYERS
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * LAYERS)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def bench_batch(batch: int) -> dict:
    layers = [layer_inputs(batch, 100 * batch + i) for i in range(LAYERS)]
    state_bytes = 2 * batch * HEADS * P * N * 4  # fp32 state read + write
    base = layers[0]
    ref_conv, ref_states = base["conv"].clone(), base["states"].clone()
    ref = step(base, ref_conv, ref_states, {"split_p": 0})
    rows = []
    for split in SPLITS:
        for warps in WARPS:
            cfg = {"split_p": split, "num_warps": warps}
            row = {"config": cfg}
            try:
                conv, states = base["conv"].clone(), base["states"].clone()
                out = step(base, conv, states, cfg)
                row["err"] = rel_err(out, ref)
                row["ok"] = row["err"] < 2e-2 and torch.equal(conv, ref_conv) and rel_err(states, ref_states) < 1e-5
                pools = [(a["conv"].clone(), a["states"].clone()) for a in layers]
                row["us"] = graph_us(lambda: [step(a, c, s, cfg) for a, (c, s) in zip(layers, pools)])
                row["tb_s"] = state_bytes / row["us"] / 1e6
            except Exception as e:  # a config over the resource limits: report, keep going
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.append(row)
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["us"], default=None)
    walk = min((r for r in good if r["config"]["split_p"] == 0), key=lambda r: r["us"], default=None)
    print(f"B={batch:3d}: best {best['config'] if best else None} {best['us'] if best else float('nan'):.1f} us "
          f"({best['tb_s'] if best else 0:.2f} TB/s); group walk {walk['us'] if walk else float('nan'):.1f} us; "
          f"bad {[r['config'] for r in rows if not r.get('ok')]}", flush=True)
    return {"batch": batch, "rows": rows, "best": best, "walk": walk}


def table_entry(results: list[dict]) -> dict:
    """{"default": the largest batch's best, "p64_n128": {"by_batch": {B: best config}}} for every batch measured."""
    bests = {r["batch"]: r["best"]["config"] for r in results if r["best"]}
    if not bests:
        return {}
    largest = bests[max(bests)]
    key = f"p{P}_n{N}"
    return {"default": {"num_warps": largest["num_warps"]},
            key: {"by_batch": {str(b): cfg for b, cfg in sorted(bests.items()) if b < max(bests)},
                  "split_p": largest["split_p"], "num_warps": largest["num_warps"]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    results = [bench_batch(b) for b in BATCHES]
    table = table_entry(results)
    path = Path(args.out, "mamba_decode_sweep.json")
    path.write_text(json.dumps({"device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(),
                                "results": results, "table": table, "elapsed_s": time.time() - start}, indent=1))
    print('"mamba_decode" entry for armillary_nemotron/tuning/sm_90.json:\n' + json.dumps(table))
    print(f"done in {time.time() - start:.0f} s -> {path}")


if __name__ == "__main__":
    main()
