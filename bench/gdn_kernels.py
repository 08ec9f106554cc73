"""Real-shape check, micro-benchmark and small tuning sweep of the Gated DeltaNet Triton kernels
(fused decode step, chunked prefill, varlen causal conv1d), with flash-linear-attention beside them.

    python bench/gdn_kernels.py --out DIR            # GPU: everything, results in DIR/gdn_kernels.json
    python bench/gdn_kernels.py --out DIR --smoke    # CPU (TRITON_INTERPRET=1): tiny shapes, logic only

Shapes are Qwen3-Next / Qwen3.6 GDN (H=16 qk heads, HV=32 v heads, K=V=128, conv 8192 channels,
kernel 4), bf16 activations, fp32 states. Errors are max|out - ref| / max|ref| against the fp32
references (layer math for decode, ``chunk_gated_delta_rule_ref``, ``causal_conv1d_varlen``); fla's
own error on the same inputs is printed beside ours. Decode "graph" times are one CUDA graph of 30
layer calls with distinct per-layer state buffers (cold in L2), divided by 30. fla's decode is its
fused recurrent step only (gate, beta sigmoid and q/k L2 norm in kernel; no conv, no output norm).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from armillary.kernels.conv1d import causal_conv1d_varlen  # noqa: E402
from armillary.kernels.norm import gated_rms_norm  # noqa: E402
from armillary.kernels.triton.causal_conv1d import causal_conv1d_prefill  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)
from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk import chunk_gated_delta_rule  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import fused_gdn_decode  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
H, HV, K, V, KW = (1, 2, 16, 16, 4) if SMOKE else (16, 32, 128, 128, 4)
CONV_DIM = 2 * H * K + HV * V
DECODE_BATCHES = [1, 3] if SMOKE else [1, 8, 64]
PREFILL = {"t70": [70]} if SMOKE else {"t2k": [2048], "t16k": [16384], "mix": [1, 5, 63, 70, 1000, 3000, 8000]}
LAYERS = 2 if SMOKE else 30
DECODE_SWEEP = [{"num_warps": w} for w in ((4,) if SMOKE else (4, 8, 16))]
CHUNK_SWEEP = [{}] if SMOKE else [
    {"state_bv": 64}, {"state_warps": 2}, {"state_stages": 2}, {"state_stages": 4},
    {"out_bv": 128, "out_warps": 8}, {"out_bk": 128}, {"out_stages": 3}, {"intra_warps": 1}, {"intra_warps": 4},
]
CONV_SWEEP = [{"BLOCK_T": 16, "BLOCK_C": 32}] if SMOKE else [
    {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}, {"BLOCK_T": 16, "BLOCK_C": 256, "num_warps": 4},
    {"BLOCK_T": 64, "BLOCK_C": 128, "num_warps": 8}, {"BLOCK_T": 32, "BLOCK_C": 256, "num_warps": 8},
    {"BLOCK_T": 64, "BLOCK_C": 64, "num_warps": 4},
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_us(fn) -> float:
    """Median time of fn in microseconds (L2 flushed between runs by do_bench)."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(*shape, generator=gen, device=DEVICE)


def gdn_params(gen: torch.Generator) -> dict:
    """One layer's GDN parameters at checkpoint-like scales (A in [1, 16], dt in [1e-3, 1e-1])."""
    dt = torch.exp(rand(HV, gen=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "conv_weight": randn(CONV_DIM, KW, gen=gen, scale=0.3, dtype=DTYPE),
        "A_log": torch.log(rand(HV, gen=gen) * 15 + 1),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),
        "norm_weight": (1 + randn(V, gen=gen, scale=0.1)).to(DTYPE),
    }


# ---------------------------------------------------------------- decode
def decode_inputs(batch: int, gen: torch.Generator) -> dict:
    slots = batch + 4
    return {
        **gdn_params(gen),
        "mixed": randn(batch, CONV_DIM + HV * V + 2 * HV, gen=gen, dtype=DTYPE),
        "conv_states": randn(slots, CONV_DIM, KW - 1, gen=gen, dtype=DTYPE),
        "ssm_states": randn(slots, HV, K, V, gen=gen, scale=0.1),
        "state_slots": torch.randperm(slots, generator=gen, device=DEVICE)[:batch],
    }


def decode_call(x: dict, config: dict | None = None) -> torch.Tensor:
    return fused_gdn_decode(x["mixed"], x["conv_weight"], x["conv_states"], x["ssm_states"], x["A_log"],
                            x["dt_bias"], x["norm_weight"], 1e-6, x["state_slots"], H, K, V, config=config)


def decode_reference(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer math in fp32 torch: (out, conv_states, ssm_states) after the step."""
    batch = x["mixed"].shape[0]
    conv, ssm, slots = x["conv_states"].clone(), x["ssm_states"].clone(), x["state_slots"]
    qkv, z, b, a = x["mixed"].float().split([CONV_DIM, HV * V, HV, HV], dim=-1)
    qkv = causal_conv1d_varlen(qkv, x["conv_weight"].float(), None, conv, slots, list(range(batch + 1)))
    q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
    g = -x["A_log"].exp() * F.softplus(a + x["dt_bias"])
    o, final = recurrent_gated_delta_rule_ref(q.reshape(batch, H, K), k.reshape(batch, H, K),
                                              v.reshape(batch, HV, V), g, b.sigmoid(), list(range(batch + 1)),
                                              initial_state=ssm[slots])
    ssm[slots] = final
    out = gated_rms_norm(o, z.reshape(batch, HV, V), x["norm_weight"].float(), 1e-6).reshape(batch, -1)
    return out, conv, ssm


def graph_us(calls) -> float:
    """Per-call time of ``calls`` (a list of thunks) captured back to back in one CUDA graph."""
    if SMOKE:
        return bench_us(lambda: [c() for c in calls]) / len(calls)
    for c in calls:  # warm-up: compile / autotune outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return bench_us(graph.replay) / len(calls)


def fla_decode_calls(layers: list[dict]):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    calls = []
    for x in layers:
        batch = x["mixed"].shape[0]
        qkv, _, b, a = x["mixed"].split([CONV_DIM, HV * V, HV, HV], dim=-1)
        q, k, v = (t.contiguous() for t in qkv.split([H * K, H * K, HV * V], dim=-1))
        args = (q.view(batch, 1, H, K), k.view(batch, 1, H, K), v.view(batch, 1, HV, V),
                a.reshape(batch, 1, HV).contiguous())
        h0 = x["ssm_states"][x["state_slots"]].contiguous()
        b = b.reshape(batch, 1, HV).contiguous()
        calls.append(lambda args=args, b=b, h0=h0, x=x: fused_recurrent_gated_delta_rule(
            *args, beta=b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True))
    return calls


def run_decode(results: dict, use_fla: bool, sweep: bool) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for batch in DECODE_BATCHES:
        x = decode_inputs(batch, gen)
        ref_out, ref_conv, ref_ssm = decode_reference(x)
        out = decode_call(x)
        row = {"err_out": rel_err(out, ref_out), "err_ssm": rel_err(x["ssm_states"], ref_ssm),
               "conv_exact": bool(torch.equal(x["conv_states"], ref_conv))}
        layers = [decode_inputs(batch, gen) for _ in range(LAYERS)]
        configs = DECODE_SWEEP if sweep else [{}]
        for cfg in configs:
            key = "default" if not cfg else "w%d" % cfg["num_warps"]
            row[f"eager_us_{key}"] = bench_us(lambda: decode_call(x, cfg))
            row[f"graph_us_{key}"] = graph_us([lambda y=y: decode_call(y, cfg) for y in layers])
        state_bytes = 2 * batch * HV * K * V * 4  # read + write of the fp32 states dominates
        best = min(v for k_, v in row.items() if k_.startswith("graph_us"))
        row["graph_best_us"] = best
        row["graph_best_GBps"] = state_bytes / best / 1e3
        if use_fla:
            try:
                fla_calls = fla_decode_calls(layers)
                row["fla_eager_us"] = bench_us(fla_calls[0])
                row["fla_graph_us"] = graph_us(fla_calls)
                row["ratio_graph_vs_fla"] = best / row["fla_graph_us"]
            except Exception as exc:  # fla is only a yardstick: record and go on
                row["fla_error"] = repr(exc)
        results["decode"][f"B{batch}"] = row
        print(f"decode B={batch}: {json.dumps(row)}", flush=True)


# ---------------------------------------------------------------- prefill
def prefill_inputs(lengths: list[int], gen: torch.Generator) -> dict:
    total = sum(lengths)
    p = gdn_params(gen)
    a = randn(total, HV, gen=gen)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return {
        "q": randn(total, H, K, gen=gen, dtype=DTYPE),
        "k": randn(total, H, K, gen=gen, dtype=DTYPE),
        "v": randn(total, HV, V, gen=gen, dtype=DTYPE),
        "g": -p["A_log"].exp() * F.softplus(a + p["dt_bias"]),
        "beta": rand(total, HV, gen=gen).to(DTYPE),
        "h0": randn(len(lengths), HV, K, V, gen=gen, scale=0.1),
        "cu_list": cu,
        "cu": torch.tensor(cu, dtype=torch.int32, device=DEVICE),
    }


def prefill_call(x: dict, config: dict | None = None):
    return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], initial_state=x["h0"],
                                  cu_seqlens_cpu=x["cu_list"], config=config)


def fla_prefill_call(x: dict):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    cu_long = x["cu"].long()
    return lambda: fla_chunk(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
                             initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             cu_seqlens=cu_long, cu_seqlens_cpu=torch.tensor(x["cu_list"]))


def run_prefill(results: dict, use_fla: bool) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for name, lengths in PREFILL.items():
        x = prefill_inputs(lengths, gen)
        ref_o, ref_s = chunk_gated_delta_rule_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_list"],
                                                  initial_state=x["h0"])
        o, s = prefill_call(x)
        row = {"tokens": sum(lengths), "err_o": rel_err(o, ref_o), "err_state": rel_err(s, ref_s),
               "us": bench_us(lambda: prefill_call(x))}
        if use_fla:
            try:
                fla = fla_prefill_call(x)
                fo, fs = fla()
                row.update(fla_err_o=rel_err(fo[0], ref_o), fla_err_state=rel_err(fs, ref_s), fla_us=bench_us(fla))
                row["ratio_vs_fla"] = row["us"] / row["fla_us"]
            except Exception as exc:  # fla is only a yardstick: record and go on
                row["fla_error"] = repr(exc)
        results["prefill"][name] = row
        print(f"prefill {name}: {json.dumps(row)}", flush=True)


def run_chunk_sweep(results: dict) -> None:
    """One knob at a time against the defaults, on the longest single sequence."""
    name = list(PREFILL)[1] if len(PREFILL) > 1 else list(PREFILL)[0]
    x = prefill_inputs(PREFILL[name], torch.Generator(device=DEVICE).manual_seed(2))
    rows = {"default": bench_us(lambda: prefill_call(x))}
    for cfg in CHUNK_SWEEP:
        rows[json.dumps(cfg)] = bench_us(lambda: prefill_call(x, cfg))
    results["chunk_sweep"][name] = rows
    print(f"chunk sweep {name}: {json.dumps(rows)}", flush=True)


# ---------------------------------------------------------------- conv
def run_conv(results: dict) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for name, lengths in PREFILL.items():
        total = sum(lengths)
        wide = randn(total, CONV_DIM + HV * V + 2 * HV, gen=gen, dtype=DTYPE)
        x = wide[:, :CONV_DIM]  # the q‖k‖v columns of an in_proj output
        weight = randn(CONV_DIM, KW, gen=gen, scale=0.3, dtype=DTYPE)
        states = randn(len(lengths) + 2, CONV_DIM, KW - 1, gen=gen, dtype=DTYPE)
        slots = torch.arange(len(lengths), device=DEVICE) + 1
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        ref_states = states.clone()
        ref = causal_conv1d_varlen(x, weight, None, ref_states, slots, cu)
        row = {"tokens": total}
        for cfg in CONV_SWEEP:
            got_states = states.clone()
            out = causal_conv1d_prefill(x, weight, None, got_states, slots, cu_dev, cu_seqlens_cpu=cu, config=cfg)
            key = "T%d_C%d_w%d" % (cfg["BLOCK_T"], cfg["BLOCK_C"], cfg.get("num_warps", 4))
            row[f"err_{key}"] = rel_err(out, ref)
            row[f"states_exact_{key}"] = bool(torch.equal(got_states, ref_states))
            us = bench_us(lambda: causal_conv1d_prefill(x, weight, None, got_states, slots, cu_dev,
                                                        cu_seqlens_cpu=cu, config=cfg))
            row[f"us_{key}"] = us
            row[f"GBps_{key}"] = 2 * total * CONV_DIM * x.element_size() / us / 1e3
        results["conv"][name] = row
        print(f"conv {name}: {json.dumps(row)}", flush=True)


# ---------------------------------------------------------------- compile ahead, in parallel
def _warm_one(job: tuple[str, dict]) -> str:
    """Runs one kernel config once at the real head dims on a tiny problem: fills Triton's disk cache."""
    kind, cfg = job
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    with torch.no_grad():
        if kind == "decode":
            decode_call(decode_inputs(2, gen), cfg)
        elif kind == "chunk":
            prefill_call(prefill_inputs([130], gen), cfg)
        else:
            x = randn(64, CONV_DIM, gen=gen, dtype=DTYPE)
            states = randn(2, CONV_DIM, KW - 1, gen=gen, dtype=DTYPE)
            causal_conv1d_prefill(x, randn(CONV_DIM, KW, gen=gen, dtype=DTYPE), None, states,
                                  torch.tensor([1], device=DEVICE), [0, 64], config=cfg)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return f"{kind} {json.dumps(cfg)}"


def warm_compile(sweep: bool) -> None:
    jobs = [("decode", {}), ("chunk", {}), ("conv", {})]
    if sweep:
        jobs += [("decode", c) for c in DECODE_SWEEP] + [("chunk", c) for c in CHUNK_SWEEP]
        jobs += [("conv", c) for c in CONV_SWEEP]
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        for msg in pool.map(_warm_one, jobs):
            print(f"  compiled {msg}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    use_fla = not (SMOKE or args.no_fla)
    if use_fla:
        try:
            import fla  # noqa: F401
        except ImportError as exc:
            print(f"fla not importable, skipping it: {exc}", flush=True)
            use_fla = False
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
               "decode": {}, "prefill": {}, "chunk_sweep": {}, "conv": {}}
    path = os.path.join(args.out, "gdn_kernels.json")
    steps = [] if SMOKE else [lambda: warm_compile(not args.no_sweep)]
    steps += [lambda: run_decode(results, use_fla, not args.no_sweep), lambda: run_conv(results),
              lambda: run_prefill(results, use_fla)]
    if not args.no_sweep:
        steps.append(lambda: run_chunk_sweep(results))
    for step in steps:
        start = time.time()
        try:
            step()
        except Exception:  # keep what the other steps measure
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc(limit=3))
        print(f"  step took {time.time() - start:.1f}s", flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
