"""Launch-config sweep of the fused Gated DeltaNet decode step (``fused_gdn_decode``) per batch size.

    python bench/gdn_decode_sweep.py --out DIR            # H200: ~1 min, DIR/gdn_decode_sweep.json
    python bench/gdn_decode_sweep.py --out DIR --smoke    # CPU (TRITON_INTERPRET=1): tiny shapes, logic only

Real shapes are Qwen3.6-35B-A3B's GDN layer (H=16 key heads, HV=32 value heads, K=V=128, conv
kernel 4), bf16 activations, fp32 states. Each config is checked first against the current
kernel (the key-head walk, ``split_bv`` 0, 4 warps) over three steps in a row on the GPU: max
|err| / max |ref| of the outputs and states, conv windows bitwise, the ticket counters back at 0,
and a repeat of the first step bitwise equal (determinism). Then it is timed as 20 launches back to
back in one CUDA graph, each launch on its own layer's parameters and state pool (do_bench clears
L2 before every replay), as µs per launch; TB/s counts the fp32 state read + write only. "floor" is
20 one-element adds in a graph: the per-node cost no launch gets under. Last, the best config per
batch and the ``gdn_decode`` entry for tuning/sm_90.json that they make.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from armillary.kernels.triton.device_buffers import ticket_buffer  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import (  # noqa: E402
    decode_config,
    fused_gdn_decode,
)

DEVICE = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
H, HV, K, V, KW = (2, 4, 16, 24, 4) if SMOKE else (16, 32, 128, 128, 4)
CONV_DIM = 2 * H * K + HV * V
LAUNCHES = 2 if SMOKE else 20
REFERENCE = {"split_bv": 0, "num_warps": 4}  # today's kernel
# (split_bv, num_warps): 0 = a program per (token, key head); BV = a program per (token, value head, BV columns)
CONFIGS = [(0, 4), (8, 1), (8, 2), (16, 2)] if SMOKE else [
    (0, 4), (0, 8), (0, 16),
    (8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4),
    (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (128, 16),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def layer(batch: int, gen: torch.Generator) -> dict:
    """One layer's parameters, a fresh step's in_proj rows and its own state pool (2 spare slots)."""
    slots = batch + 2
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, device=DEVICE) * scale  # noqa: E731
    return {
        "mixed": rnd(batch, CONV_DIM + HV * V + 2 * HV).to(DTYPE),
        "conv_weight": rnd(CONV_DIM, KW, scale=0.3).to(DTYPE),
        "conv_states": rnd(slots, CONV_DIM, KW - 1).to(DTYPE),
        "ssm_states": rnd(slots, HV, K, V, scale=0.1),
        "A_log": torch.log(torch.rand(HV, generator=gen, device=DEVICE) * 15 + 1),
        "dt_bias": rnd(HV, scale=0.5) - 3.0,
        "norm_weight": (1 + rnd(V, scale=0.1)).to(DTYPE),
        "state_slots": torch.randperm(slots, generator=gen, device=DEVICE)[:batch],
    }


def call(x: dict, cfg: dict | None, mixed: torch.Tensor | None = None) -> torch.Tensor:
    return fused_gdn_decode(x["mixed"] if mixed is None else mixed, x["conv_weight"], x["conv_states"],
                            x["ssm_states"], x["A_log"], x["dt_bias"], x["norm_weight"], 1e-6, x["state_slots"],
                            H, K, V, config=cfg)


def check(x: dict, cfg: dict, steps: list[torch.Tensor]) -> dict:
    """The config against REFERENCE over consecutive steps, each on its own copy of the states."""
    runs = {}
    for name, c in (("ref", REFERENCE), ("cfg", cfg)):
        y = {**x, "conv_states": x["conv_states"].clone(), "ssm_states": x["ssm_states"].clone()}
        outs = [call(y, c, m) for m in steps]
        runs[name] = (outs, y["conv_states"], y["ssm_states"])
    repeat = {**x, "conv_states": x["conv_states"].clone(), "ssm_states": x["ssm_states"].clone()}
    first = call(repeat, cfg, steps[0])
    (ref_outs, ref_conv, ref_ssm), (outs, conv, ssm) = runs["ref"], runs["cfg"]
    tickets = ticket_buffer(DEVICE, 0)
    return {
        "err_out": max(rel_err(o, r) for o, r in zip(outs, ref_outs)),
        "err_state": rel_err(ssm, ref_ssm),
        "conv_exact": bool(torch.equal(conv, ref_conv)),
        "tickets_zero": not bool(tickets.any()),
        "deterministic": bool(torch.equal(first, outs[0])),
    }


def graph_us(thunks: list) -> float:
    """µs per thunk, the thunks captured back to back in one CUDA graph (L2 cleared before each replay)."""
    if SMOKE:
        start = time.perf_counter()
        for t in thunks:
            t()
        return (time.perf_counter() - start) * 1e6 / len(thunks)
    for t in thunks:  # compile and grow the scratch outside the capture
        t()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in thunks:
            t()
    us = triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3
    return us / len(thunks)


def compile_all(results: dict) -> set[str]:
    """Compiles every config once (at batch 1: the specialisation does not depend on it); the names
    of those that fail, which the sweep then skips."""
    x, failed = layer(1, torch.Generator(device=DEVICE).manual_seed(99)), set()
    for bv, w in CONFIGS:
        name, start = f"bv{bv}_w{w}", time.perf_counter()
        try:
            call(x, {"split_bv": bv, "num_warps": w})
            if not SMOKE:
                torch.cuda.synchronize()
        except Exception as exc:  # recorded and skipped
            failed.add(name)
            results.setdefault("compile_errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"compile {name}: {results['compile_errors'][name]}", flush=True)
        results.setdefault("compile_s", {})[name] = round(time.perf_counter() - start, 2)
    return failed


def sweep_batch(batch: int, deadline: float, results: dict, failed: set[str]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    layers = [layer(batch, gen) for _ in range(LAUNCHES)]
    steps = [layers[0]["mixed"]] + [torch.randn(layers[0]["mixed"].shape, generator=gen, device=DEVICE).to(DTYPE)
                                    for _ in range(2)]  # three steps in a row
    state_bytes = 2 * batch * HV * K * V * 4
    rows = {}
    if not SMOKE:
        one = torch.zeros(1, device=DEVICE)
        rows["floor"] = {"us": graph_us([lambda: one.add_(1)] * LAUNCHES)}
        print(f"B={batch:<3} {'floor (one-element add)':44} {rows['floor']['us']:8.2f} us", flush=True)
    table = decode_config(batch, K, V, DEVICE)
    todo = [("table " + json.dumps(table, sort_keys=True), None)]
    todo += [(f"bv{bv}_w{w}", {"split_bv": bv, "num_warps": w}) for bv, w in CONFIGS]
    for name, cfg in todo:
        if name in failed or time.perf_counter() > deadline:
            rows[name] = {"skipped": "compile error" if name in failed else "time budget"}
            continue
        try:
            row = check(layers[0], table if cfg is None else cfg, steps)
            row["us"] = graph_us([lambda x=x: call(x, cfg) for x in layers])
            row["TBps"] = state_bytes / row["us"] / 1e6
            row["tickets_zero"] &= not bool(ticket_buffer(DEVICE, 0).any())  # after all the replays too
        except Exception as exc:  # a config that fails to compile or run: record it and go on
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc(limit=2)
        rows[name] = row
        print(f"B={batch:<3} {name:44} " + (
            f"{row['us']:8.2f} us {row['TBps']:5.2f} TB/s  err out {row['err_out']:.1e} state {row['err_state']:.1e}"
            f"  conv {'ok' if row['conv_exact'] else 'DIFF'} tickets {'ok' if row['tickets_zero'] else 'NONZERO'}"
            f" det {'ok' if row['deterministic'] else 'NO'}" if "us" in row else str(row)), flush=True)
    results[f"B{batch}"] = rows


def good(row: dict) -> bool:
    return ("us" in row and row["err_out"] < 2e-2 and row["err_state"] < 1e-3 and row["conv_exact"]
            and row["tickets_zero"] and row["deterministic"])


def recommend(results: dict) -> dict:
    """Fastest correct config per batch; the largest batch's is the default, the others go in by_batch."""
    best = {}
    for key, rows in results.items():
        if not key.startswith("B"):
            continue
        cands = {n: r for n, r in rows.items() if n.startswith("bv") and good(r)}
        if cands:
            name = min(cands, key=lambda n: cands[n]["us"])
            bv, w = name[2:].split("_w")
            best[int(key[1:])] = {"split_bv": int(bv), "num_warps": int(w), "us": cands[name]["us"],
                                  "today_us": rows.get("bv0_w4", {}).get("us")}
    if not best:
        return {}
    strip = lambda b: {k: v for k, v in b.items() if k in ("split_bv", "num_warps")}  # noqa: E731
    largest = max(best)
    entry = {"default": {**strip(best[largest])}}
    smaller = [b for b in sorted(best) if b != largest]
    while smaller and strip(best[smaller[-1]]) == strip(best[largest]):  # a key covers every batch below it
        smaller.pop()
    smaller = {str(b): strip(best[b]) for b in smaller}
    if smaller:
        entry["default"]["by_batch"] = smaller
    return {"best": {str(b): v for b, v in best.items()}, "gdn_decode": entry}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for gdn_decode_sweep.json")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--batches", default="1,3" if SMOKE else "1,8,64")
    parser.add_argument("--budget-s", type=float, default=80.0, help="stop starting configs after this long")
    args = parser.parse_args()
    start = time.perf_counter()
    results: dict = {"shapes": dict(H=H, HV=HV, K=K, V=V, KW=KW, dtype=str(DTYPE), launches=LAUNCHES)}
    if not SMOKE:
        results["device"] = torch.cuda.get_device_name()
        results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    batches = [int(b) for b in args.batches.split(",")]
    failed = compile_all(results)
    print(f"compiled {len(CONFIGS)} configs in {time.perf_counter() - start:.0f} s", flush=True)
    for i, batch in enumerate(batches):
        # an even share of what is left for each batch, so the largest is not starved
        share = (args.budget_s - (time.perf_counter() - start)) / (len(batches) - i)
        sweep_batch(batch, time.perf_counter() + share, results, failed)
        if not SMOKE:
            torch.cuda.empty_cache()
    results["recommended"] = recommend(results)
    results["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_decode_sweep.json").write_text(json.dumps(results, indent=1))
    print("\nbest per batch:", json.dumps(results["recommended"].get("best", {})))
    print("tuning/sm_90.json entry:\n" + json.dumps({"gdn_decode": results["recommended"].get("gdn_decode")},
                                                       indent=2))
    print(f"({results['seconds']:.0f} s, {out / 'gdn_decode_sweep.json'})")


if __name__ == "__main__":
    main()
