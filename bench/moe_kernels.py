"""Micro-benchmark, correctness check and tuning sweep of the Triton MoE, RMSNorm and rotary kernels.

    python bench/moe_kernels.py --out DIR            # GPU: everything, results in DIR/moe_kernels.json
    python bench/moe_kernels.py --out DIR --smoke    # CPU (TRITON_INTERPRET=1): tiny shapes, logic only

Shapes are the real ones (MODELS.md) with random weights. Errors are max|out - ref| / max|ref| against
the float32 reference (armillary.kernels.moe.fused_moe on upcast weights); the bf16 torch reference's
own error is printed beside it. Bandwidth for decode counts the bytes of the distinct experts touched.
Candidate kernel configs are compiled in parallel worker processes first (Triton's disk cache), then
timed in the main process with triton.testing.do_bench (CUDA graphs where noted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from armillary.kernels import moe as ref_moe  # noqa: E402
from armillary.kernels import norm as ref_norm  # noqa: E402
from armillary.kernels.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq  # noqa: E402
from armillary.kernels.triton.moe import fused_moe, grouped_config_key  # noqa: E402
from armillary.kernels import tuning  # noqa: E402

tuning.use_packages(("armillary_qwen_gdn_moe",))  # Qwen3.6 shapes: the shipped tables as the served model reads them
from armillary.kernels.triton.moe_align import moe_align  # noqa: E402
from armillary.kernels.triton.moe_routing import topk_softmax  # noqa: E402
from armillary.kernels.triton.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from armillary.kernels.triton.rotary import rotary_cos_sin_cache, rotary_embedding_  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16


@dataclass(slots=True)
class MoeShape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str


SHAPES = {
    "qwen3.6": MoeShape("qwen3.6", 256, 8, 2048, 512, "silu"),
    "qwen3-next": MoeShape("qwen3-next", 512, 10, 2048, 512, "silu"),
    "nemotron": MoeShape("nemotron", 128, 6, 2688, 1856, "relu2"),
    "glm": MoeShape("glm", 64, 4, 2048, 1536, "silu"),
}
if SMOKE:
    SHAPES = {name: MoeShape(name, 6, 2, 32, 16 if s.activation == "silu" else 48, s.activation) for name, s in SHAPES.items()}

# grouped-GEMM candidates: (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M, gemm 1 then gemm 2
G1 = {
    16: [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3)],
    32: [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3)],
    64: [(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 3)],
    128: [(64, 64, 4, 4), (128, 64, 8, 4), (64, 64, 8, 4), (128, 64, 8, 3)],
}
G2 = {
    16: [(64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4)],
    32: [(64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4)],
    64: [(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3)],
    128: [(128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3)],
}
BUCKET_TOKENS = {"r8": (128, [16, 32]), "r32": (512, [16, 32, 64]), "r128": (2048, [64, 128]), "r512": (16384, [64, 128])}
D1 = [(16, 128, 4, 4), (32, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (16, 128, 2, 4)]
D2 = [(32, 128, 4, 4), (64, 128, 4, 4), (16, 128, 2, 4), (64, 256, 4, 3), (128, 64, 4, 4)]
if SMOKE:
    G1 = G2 = {16: [(16, 16, 2, 1)], 32: [(16, 16, 2, 1)], 64: [(16, 16, 2, 1)], 128: [(16, 16, 2, 1)]}
    BUCKET_TOKENS = {"r8": (3, [16]), "r32": (40, [16])}
    D1 = D2 = [(16, 16, 2, 1), (32, 16, 2, 1)]


def grouped_cfg(block_m: int, g1: tuple, g2: tuple) -> dict:
    return {"BLOCK_M": block_m, "GROUP_M": 8, "BLOCK_N1": g1[0], "BLOCK_K1": g1[1], "num_warps1": g1[2], "num_stages1": g1[3],
            "BLOCK_N2": g2[0], "BLOCK_K2": g2[1], "num_warps2": g2[2], "num_stages2": g2[3]}  # fmt: skip


def decode_cfg(d1: tuple, d2: tuple) -> dict:
    return {"BLOCK_N1": d1[0], "BLOCK_K1": d1[1], "num_warps1": d1[2], "num_stages1": d1[3],
            "BLOCK_N2": d2[0], "BLOCK_K2": d2[1], "num_warps2": d2[2], "num_stages2": d2[3]}  # fmt: skip


def bench_ms(fn, graph: bool = False) -> float:
    """Median ms of fn; inside a CUDA graph when ``graph``. Smoke mode: one wall-clock run."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median")


class Moe:
    """Random weights and routed inputs of one MoE shape (weights made once, inputs per token count)."""

    def __init__(self, shape: MoeShape, seed: int = 0) -> None:
        self.shape = shape
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        rows = 2 * shape.inter if shape.activation == "silu" else shape.inter
        self.w13 = (torch.randn(shape.experts, rows, shape.hidden, device=DEVICE, generator=g) / shape.hidden**0.5).to(DTYPE)
        self.w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, device=DEVICE, generator=g) / shape.inter**0.5).to(DTYPE)

    def inputs(self, tokens: int, seed: int = 1):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        x = torch.randn(tokens, self.shape.hidden, device=DEVICE, generator=g).to(DTYPE)
        logits = torch.randn(tokens, self.shape.experts, device=DEVICE, generator=g)
        weights, ids = topk_softmax(logits, self.shape.top_k, True)
        return x, weights, ids

    def run(self, x, weights, ids, path="auto", config=None):
        return fused_moe(x, self.w13, self.w2, weights, ids, self.shape.activation, path=path, config=config)

    def expert_bytes(self, ids: torch.Tensor) -> int:
        per_expert = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        return int(torch.unique(ids).numel()) * per_expert

    def flops(self, tokens: int) -> float:
        s = self.shape
        rows = 2 * s.inter if s.activation == "silu" else s.inter
        return 2.0 * tokens * s.top_k * (rows + s.inter) * s.hidden


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


CORRECTNESS_PLAN = {"qwen3.6": (1, 8, 64, 2048, 16384), "qwen3-next": (8, 2048), "nemotron": (1, 8, 2048), "glm": (8, 2048)}
CROSSOVER_TOKENS = (1, 2, 4, 8, 16, 32)
if SMOKE:
    CORRECTNESS_PLAN = {name: (1, 5) for name in CORRECTNESS_PLAN}
    CROSSOVER_TOKENS = (1, 4)


def decode_key(num_pairs: int) -> str:
    return f"p{max(16, 1 << (num_pairs - 1).bit_length())}"


def sweep_jobs() -> list[tuple]:
    """(model, path, tokens, config) of every candidate the --tune sweep launches."""
    jobs = []
    for bucket, (tokens, block_ms) in BUCKET_TOKENS.items():
        for bm in block_ms:
            jobs += [("qwen3.6", "grouped", tokens, grouped_cfg(bm, g1, G2[bm][0])) for g1 in G1[bm]]
            jobs += [("qwen3.6", "grouped", tokens, grouped_cfg(bm, G1[bm][0], g2)) for g2 in G2[bm][1:]]
    for tokens in (1, 8):
        jobs += [("qwen3.6", "decode", tokens, decode_cfg(d1, D2[0])) for d1 in D1]
        jobs += [("qwen3.6", "decode", tokens, decode_cfg(D1[0], d2)) for d2 in D2[1:]]
    return jobs


def check_jobs() -> list[tuple]:
    """Launches of the crossover and correctness sections (shipped tables, config None)."""
    jobs = [("qwen3.6", path, tokens, None) for tokens in CROSSOVER_TOKENS for path in ("decode", "grouped")]
    for name, token_list in CORRECTNESS_PLAN.items():
        for tokens in token_list:
            jobs.append((name, "auto", tokens, None))
            if tokens * SHAPES[name].top_k <= 128:
                jobs += [(name, "decode", tokens, None), (name, "grouped", tokens, None)]
    return jobs


def warm_worker(jobs: list[tuple]) -> int:
    models: dict[str, Moe] = {}
    done = 0
    for name, path, tokens, cfg in jobs:
        moe = models.setdefault(name, Moe(SHAPES[name]))
        x, w, ids = moe.inputs(tokens)
        try:
            moe.run(x, w, ids, path, cfg)
            done += 1
        except Exception as e:  # the timed run reports it; warming just moves on
            print(f"warm {name} {path} T={tokens} {cfg}: {type(e).__name__}: {e}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done


def warm_compile(workers: int, jobs: list[tuple]) -> None:
    """Compile every known launch in worker processes so the timed runs load kernels from disk."""
    if workers <= 1:
        return
    import multiprocessing as mp

    chunks = [jobs[i::workers] for i in range(workers)]
    start = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(warm_worker, chunks))
    print(f"warm-up: {done}/{len(jobs)} launches compiled in {workers} processes, {time.time() - start:.0f} s", flush=True)


def safe_ms(fn, graph: bool = False) -> float:
    """bench_ms, or inf (printed) when the launch fails, e.g. a config that needs too much shared memory."""
    try:
        return bench_ms(fn, graph)
    except Exception as e:
        print(f"  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("inf")


def tune(results: dict) -> None:
    """Sweep the candidates; prints the best per key for the tuning tables (not applied here)."""
    moe = Moe(SHAPES["qwen3.6"])
    best_grouped = {}
    for bucket, (tokens, block_ms) in BUCKET_TOKENS.items():
        x, w, ids = moe.inputs(tokens)
        assert grouped_config_key(ids.numel(), moe.shape.experts) == bucket
        best = None
        for bm in block_ms:
            g1_times = [(safe_ms(lambda: moe.run(x, w, ids, "grouped", grouped_cfg(bm, g1, G2[bm][0]))), g1) for g1 in G1[bm]]
            g1 = min(g1_times)[1]
            g2_times = [(safe_ms(lambda: moe.run(x, w, ids, "grouped", grouped_cfg(bm, g1, g2))), g2) for g2 in G2[bm]]
            ms, g2 = min(g2_times)
            print(f"tune {bucket} T={tokens} BLOCK_M={bm}: g1 {g1_times} g2 {g2_times}", flush=True)
            if best is None or ms < best[0]:
                best = (ms, grouped_cfg(bm, g1, g2))
        best_grouped[bucket] = {"ms": best[0], "tokens": tokens, "config": best[1]}
    results["tune_grouped"] = best_grouped
    best_decode = {}
    for tokens in (1, 8):  # in CUDA graphs: eager timings of these shapes are launch overhead
        x, w, ids = moe.inputs(tokens)
        d1_times = [(safe_ms(lambda: moe.run(x, w, ids, "decode", decode_cfg(d1, D2[0])), True), d1) for d1 in D1]
        d1 = min(d1_times)[1]
        d2_times = [(safe_ms(lambda: moe.run(x, w, ids, "decode", decode_cfg(d1, d2)), True), d2) for d2 in D2]
        ms, d2 = min(d2_times)
        print(f"tune decode T={tokens} (graph): up {d1_times} down {d2_times}", flush=True)
        best_decode[decode_key(ids.numel())] = {"ms": ms, "config": decode_cfg(d1, d2)}
    results["tune_decode"] = best_decode


def crossover(results: dict) -> None:
    """Decode kernels against the grouped GEMMs, both with the shipped tables, in CUDA graphs."""
    moe = Moe(SHAPES["qwen3.6"])
    rows = []
    for tokens in CROSSOVER_TOKENS:
        x, w, ids = moe.inputs(tokens)
        dec = safe_ms(lambda: moe.run(x, w, ids, "decode"), graph=True)
        grp = safe_ms(lambda: moe.run(x, w, ids, "grouped"), graph=True)
        rows.append({"tokens": tokens, "pairs": ids.numel(), "decode_us": dec * 1e3, "grouped_us": grp * 1e3})
        print(f"crossover T={tokens} pairs={ids.numel()}: decode {dec * 1e3:.1f} us, grouped {grp * 1e3:.1f} us", flush=True)
    results["crossover"] = rows


def moe_row(name: str, moe: Moe, w13f: torch.Tensor, w2f: torch.Tensor, tokens: int) -> dict:
    """Errors against the float32 reference and (Qwen3.6) timings of one shape, auto path, shipped tables."""
    x, w, ids = moe.inputs(tokens)
    ref32 = ref_moe.fused_moe(x.float(), w13f, w2f, w, ids, moe.shape.activation)
    ref16 = ref_moe.fused_moe(x, moe.w13, moe.w2, w, ids, moe.shape.activation)
    row = {"model": name, "tokens": tokens, "err": rel_err(moe.run(x, w, ids), ref32), "torch_bf16_err": rel_err(ref16, ref32)}
    if ids.numel() <= 128:
        row["err_decode"] = rel_err(moe.run(x, w, ids, "decode"), ref32)
        row["err_grouped"] = rel_err(moe.run(x, w, ids, "grouped"), ref32)
    if name != "qwen3.6":
        return row
    row["us"] = safe_ms(lambda: moe.run(x, w, ids)) * 1e3
    row["ref_us"] = safe_ms(lambda: ref_moe.fused_moe(x, moe.w13, moe.w2, w, ids, moe.shape.activation)) * 1e3
    a = torch.randn(ids.numel(), moe.shape.hidden, device=DEVICE, dtype=DTYPE)
    b = torch.randn(moe.w13.shape[1] + moe.shape.inter, moe.shape.hidden, device=DEVICE, dtype=DTYPE)
    row["dense_same_flops_us"] = safe_ms(lambda: a @ b.T) * 1e3  # [T*k, H] x [H, 3I]
    row["tflops"] = moe.flops(tokens) / (row["us"] * 1e-6) / 1e12
    row["dense_tflops"] = moe.flops(tokens) / (row["dense_same_flops_us"] * 1e-6) / 1e12
    if tokens <= 64:
        row["graph_us"] = safe_ms(lambda: moe.run(x, w, ids), graph=True) * 1e3
        logits = torch.randn(tokens, moe.shape.experts, device=DEVICE, dtype=DTYPE)
        row["graph_with_router_us"] = safe_ms(lambda: moe.run(x, *topk_softmax(logits, moe.shape.top_k, True)), graph=True) * 1e3
        row["expert_bytes"] = moe.expert_bytes(ids)
        row["graph_GBps"] = row["expert_bytes"] / (row["graph_us"] * 1e-6) / 1e9
        wd = torch.randn(row["expert_bytes"] // (2 * moe.shape.hidden), moe.shape.hidden, device=DEVICE, dtype=DTYPE)
        row["dense_same_bytes_graph_us"] = safe_ms(lambda: x @ wd.T, graph=True) * 1e3
    return row


def correctness_and_timing(results: dict) -> None:
    rows = []
    for name, token_list in CORRECTNESS_PLAN.items():
        moe = Moe(SHAPES[name])
        w13f, w2f = moe.w13.float(), moe.w2.float()
        for tokens in token_list:
            try:
                row = moe_row(name, moe, w13f, w2f, tokens)
            except Exception as e:  # keep going: one broken shape must not hide the others
                row = {"model": name, "tokens": tokens, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del moe, w13f, w2f
        if not SMOKE:
            torch.cuda.empty_cache()
    results["moe"] = rows


def small_kernels(results: dict) -> None:
    out = {}
    token_list = (1, 8, 2048, 16384) if not SMOKE else (1, 5)
    hidden = 2048 if not SMOKE else 40
    for tokens in token_list:
        graph = tokens <= 8  # eager timings of tiny launches measure the CPU, not the kernel
        logits = torch.randn(tokens, 256 if not SMOKE else 6, device=DEVICE)
        k = 8 if not SMOKE else 2
        out[f"topk_softmax_T{tokens}_us"] = safe_ms(lambda: topk_softmax(logits, k, True), graph) * 1e3
        out[f"torch_softmax_topk_T{tokens}_us"] = safe_ms(lambda: ref_moe.softmax_topk(logits, k, True), graph) * 1e3
        ids = topk_softmax(logits, k, True)[1]
        out[f"moe_align_T{tokens}_us"] = safe_ms(lambda: moe_align(ids, logits.shape[1], 64), graph) * 1e3
        x, res = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE), torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
        wn = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
        normed, new_res = fused_add_rms_norm(x, res, wn, 1e-6, True)
        out[f"fused_add_rms_norm_T{tokens}_err"] = rel_err(normed, ref_norm.rms_norm(x + res, wn, 1e-6, True))
        us = safe_ms(lambda: fused_add_rms_norm(x, res, wn, 1e-6, True), graph) * 1e3
        out[f"fused_add_rms_norm_T{tokens}_us"] = us
        out[f"fused_add_rms_norm_T{tokens}_GBps"] = 4 * x.numel() * x.element_size() / (us * 1e-6) / 1e9
        out[f"torch_add_rms_norm_T{tokens}_us"] = safe_ms(lambda: ref_norm.rms_norm(x + res, wn, 1e-6, True), graph) * 1e3
        heads = 16 if not SMOKE else 3
        head_dim = 256 if not SMOKE else 24
        q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=DTYPE)
        wq = torch.randn(head_dim, device=DEVICE, dtype=DTYPE)
        out[f"qk_rms_norm_T{tokens}_err"] = rel_err(rms_norm(q, wq, 1e-6, True), ref_norm.rms_norm(q, wq, 1e-6, True))
        out[f"qk_rms_norm_T{tokens}_us"] = safe_ms(lambda: rms_norm(q, wq, 1e-6, True), graph) * 1e3
        rot = head_dim // 4
        inv_freq = rotary_inv_freq(rot, 1e7, DEVICE)
        cache = rotary_cos_sin_cache(32768 if not SMOKE else 64, inv_freq)
        positions = torch.randint(0, cache.shape[0], (tokens,), device=DEVICE)
        k_heads = torch.randn(tokens, 2, head_dim, device=DEVICE, dtype=DTYPE)
        cos, sin = rotary_cos_sin(positions, inv_freq)
        ref_q = apply_rotary(q, cos, sin)
        q2 = q.clone()
        rotary_embedding_(q2, k_heads.clone(), positions, cache)
        out[f"rotary_T{tokens}_err"] = rel_err(q2, ref_q)
        out[f"rotary_T{tokens}_us"] = safe_ms(lambda: rotary_embedding_(q2, k_heads, positions, cache), graph) * 1e3

        def torch_rotary():
            c, s = rotary_cos_sin(positions, inv_freq)
            return apply_rotary(q, c, s), apply_rotary(k_heads, c, s)

        out[f"torch_rotary_T{tokens}_us"] = safe_ms(torch_rotary, graph) * 1e3
    results["small_kernels"] = out
    print(json.dumps(out, indent=1), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also sweep candidate configs (prints the best)")
    parser.add_argument("--workers", type=int, default=1 if SMOKE else 8)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton

    results: dict = {"device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(),
                     "torch": torch.__version__, "triton": triton.__version__}  # fmt: skip
    path = os.path.join(args.out, "moe_kernels.json")
    start = time.time()
    jobs = check_jobs() + (sweep_jobs() if args.tune else [])
    steps = [lambda r: warm_compile(args.workers, jobs)] + ([tune] if args.tune else [])
    for step in steps + [crossover, correctness_and_timing, small_kernels]:
        step(results)
        results["elapsed_s"] = time.time() - start
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    print(f"done in {time.time() - start:.0f} s -> {path}")


if __name__ == "__main__":
    main()
