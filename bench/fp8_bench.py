"""FP8 benchmark at the Qwen3.6-35B-A3B-FP8 shape: fp8 weights and KV vs the roofline measured in the same run.

Random bf16 weights at the real config (``load_format="dummy"``), quantized by the engine while
loading to 128 x 128 block fp8 (``quantization="fp8_block"``: the layout of the published FP8
checkpoint). Phases (``--phase``, comma-separated; each prints one line per figure and adds to
the JSON written to ``$OUT/fp8_bench.json``):

- ``speed``: batch-1 decode (1K prompt, 256 new), 64 streams (1K prompt, 128 new), 2K and 16K prefill,
  with fp8 KV (high-precision layers ``auto``) and CUDA graphs; each against its roofline (copy
  bandwidth and fp8 ``_scaled_mm`` rate measured here).
- ``kv``: KV pool token count at the same ``--gpu-memory-utilization`` for bf16 KV, fp8 KV (auto)
  and fp8 KV (no high-precision layers), and batch-1 decode at 32K context with bf16 vs fp8 KV.
- ``logits``: 256 greedy decode steps on the fast path (Triton, eager so every logits row is
  seen), then the reference backend (weights dequantized into bf16 by the torch references)
  teacher-forced on the same tokens: per-step logits' relative error, and the steps whose
  reference argmax is the fast path's token (random weights give near-ties).
- ``kernels``: the fp8 GEMMs alone at the model's projection shapes (CUDA-graph replays, weights
  rotated past L2, from bench/fp8_gpu_checks.py): prefill rows 128-16384 on the Triton GEMM vs
  cuBLAS's block-scaled ``torch._scaled_mm`` (both with the activation quantization, which is
  also timed alone: where cuBLAS starts winning is ``fp8_scaled_mm.MIN_ROWS``), decode rows 2-64
  on the skinny GEMM with the integer e4m3 -> bf16 widening vs Triton's cast vs bf16 cuBLAS, and
  the grouped MoE at 2048 / 16384 tokens with 64- vs 128-row tiles.

    python bench/fp8_bench.py --phase speed
    python bench/fp8_bench.py --phase kv
    python bench/fp8_bench.py --phase logits
    python bench/fp8_bench.py --phase kernels
    python bench/fp8_bench.py --tiny --device cpu --phase speed,kv,logits   # smoke test of the driver
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_bench import Ours, copy_bandwidth, real_config, sync  # noqa: E402

RESULTS: dict[str, float] = {}


def report(name: str, value: float, note: str = "") -> None:
    RESULTS[name] = value
    print(f"{name}: {value:.4g}{'  ' + note if note else ''}", flush=True)


def fp8_matmul_flops(device: str) -> float:
    """fp8 dense GEMM rate of this GPU (torch._scaled_mm, 8192^3), FLOP/s; NaN where unavailable."""
    if device != "cuda":
        return float("nan")
    try:
        n = 8192
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        mm = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        for _ in range(3):
            mm()
        sync(device)
        t = time.perf_counter()
        for _ in range(20):
            mm()
        sync(device)
        return 2 * n ** 3 * 20 / (time.perf_counter() - t)
    except (RuntimeError, TypeError) as exc:  # an fp8 GEMM this build of torch does not have
        print(f"fp8 _scaled_mm unavailable ({exc}); prefill roofline not measured", flush=True)
        return float("nan")


def kv_bytes_per_token(cfg: dict, fp8_layers: int) -> int:
    full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]  # K and V values
    return (full - fp8_layers) * per_layer * 2 + fp8_layers * per_layer


def fp8_decode_bytes(cfg: dict, batch: int, context: int, fp8_kv_layers: int) -> float:
    """Bytes a decode step must move: fp8 weights touched (+ their block scales), bf16 router and
    LM head, recurrent states read and written, KV of every sequence."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    lin = layers - full
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * nq * hd * 2 + 2 * h * nkv * hd + nq * hd * h
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    gdn = h * (2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"]) + vd * h
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts for ``batch`` tokens
    moe = (touched + 1) * 3 * h * inter  # + the shared expert (as wide as a routed one)
    fp8 = full * attn + lin * gdn + layers * moe
    weights = fp8 * (1 + 4 / (128 * 128)) + 2 * (layers * h * (e + 1) + v * h)
    state = batch * lin * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4 * 2
    return weights + state + batch * context * kv_bytes_per_token(cfg, fp8_kv_layers)


def prefill_flops_per_token(cfg: dict, length: int) -> float:
    """Matmul FLOPs per prompt token: active weights (top-k + shared experts) and causal attention."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * nq * hd * 2 + 2 * h * nkv * hd + nq * hd * h
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    gdn = h * (2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"]) + vd * h
    moe = (cfg["num_experts_per_tok"] + 1) * 3 * h * cfg["moe_intermediate_size"]
    weights = full * attn + (layers - full) * gdn + layers * moe
    return 2 * weights + full * 2 * 2 * nq * hd * length / 2


def engine(path: Path, args, **kw) -> Ours:
    base = dict(quantization="fp8_block", kv_cache_dtype="fp8")
    base.update(kw)
    max_len, max_seqs, eager = base.pop("max_len"), base.pop("max_seqs", 64), base.pop("eager", args.eager)
    return Ours(path, args.device, max_len=max_len, max_seqs=max_seqs, eager=eager, **base)


def free(ours: Ours) -> None:
    """The engine's weights, caches and graphs given back, so the next engine fits (the caller's name for it is
    still bound: without ``shutdown`` the old engine held the GPU while the next one loaded)."""
    ours.llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", flush=True)


def fp8_kv_layer_count(ours: Ours) -> int:
    return sum(1 for c in ours.engine.worker.caches if getattr(c, "k_scale", None) is not None)


def pool_tokens(ours: Ours) -> int:
    plan = ours.engine.plan
    return (plan.num_blocks - 1) * plan.block_size // max(1, len(plan.paged_groups))


def phase_speed(path: Path, cfg: dict, args, bw: float, flops: float, s: int) -> None:
    ours = engine(path, args, max_len=16384 // s + 512)
    report("engine start-up s", ours.startup)
    ours.run(1, 64, 4)  # warm-up: compiles kernels outside the timings
    ours.run(1, 2048 // s, 1)
    n_fp8 = fp8_kv_layer_count(ours)
    for name, batch, prompt, new in (("decode tok/s batch 1", 1, 1024 // s, 256 // s),
                                     ("decode tok/s 64 streams", 64, 1024 // s, 128 // s)):
        res = ours.run(batch, prompt, new)
        roof = batch * bw / fp8_decode_bytes(cfg, batch, prompt + new // 2, n_fp8)
        report(name, res["decode_tok_s"], f"{res['decode_tok_s'] / roof:.0%} of roofline {roof:.0f}")
    for label, n in (("2K", 2048 // s), ("16K", 16384 // s)):
        res = ours.run(1, n, 1)
        tps = n / res["ttft"]
        roof = flops / prefill_flops_per_token(cfg, n)
        report(f"prefill tok/s {label}", tps,
               f"TTFT {res['ttft'] * 1e3:.0f} ms; {tps / roof:.0%} of fp8 roofline {roof:.0f}")
    free(ours)


def phase_kv(path: Path, cfg: dict, args, bw: float, s: int) -> None:
    ctx = 32768 // s
    tokens, decode = {}, {}
    for label, kw in (("bf16", dict(kv_cache_dtype="auto")), ("fp8", {}),
                      ("fp8 no high-precision layers", dict(kv_high_precision_layers="0"))):
        ours = engine(path, args, max_len=262144 // s, max_seqs=48, **kw)
        tokens[label] = pool_tokens(ours)
        report(f"KV pool tokens, {label}", tokens[label])
        if label != "fp8 no high-precision layers":
            ours.run(1, 64, 4)
            res = ours.run(1, ctx, 64 // min(s, 8))
            decode[label] = res["decode_tok_s"]
            roof = bw / fp8_decode_bytes(cfg, 1, ctx, fp8_kv_layer_count(ours))
            report(f"decode tok/s batch 1 at 32K, {label} KV", res["decode_tok_s"],
                   f"{res['decode_tok_s'] / roof:.0%} of roofline {roof:.0f}")
        free(ours)
    report("KV pool ratio fp8 / bf16", tokens["fp8"] / tokens["bf16"])
    report("KV pool ratio fp8 (no high-precision) / bf16", tokens["fp8 no high-precision layers"] / tokens["bf16"])
    report("decode at 32K fp8 / bf16 KV", decode["fp8"] / decode["bf16"])


def phase_logits(path: Path, args, s: int) -> None:
    """The fast path decodes greedily; the reference backend then scores the same history (teacher-forced: each
    step's prompt is the prompt plus the fast path's tokens so far, prefix caching making it a one-token step), so
    every one of the steps is compared, not only those before the first near-tie flips a token."""
    from armillary import SamplingParams
    from armillary.testing import LogitsRecorder

    steps = 256 // s
    greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    ours = engine(path, args, max_len=1024, max_seqs=1, eager=True)
    prompt = torch.randint(10, ours.vocab, (256 // s,), generator=torch.Generator().manual_seed(7)).tolist()
    rec = LogitsRecorder(ours.engine.model)
    fast_t = list(ours.llm.generate([prompt], greedy)[0].outputs[0].token_ids)
    fast_l = torch.stack(rec.rows[-steps:]).float().cpu()  # [steps, V]: the rows that chose each token
    rec.close()
    free(ours)
    ours = engine(path, args, max_len=1024, max_seqs=1, eager=True, kernel_backend="reference",
                  enable_prefix_caching=True)
    rec = LogitsRecorder(ours.engine.model)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ref_rows = []
    for i in range(steps):
        ours.llm.generate([prompt + fast_t[:i]], one)
        ref_rows.append(rec.take()[-1].float().cpu())  # the row that predicts token i
    ref_l = torch.stack(ref_rows)
    rec.close()
    free(ours)
    err = (fast_l - ref_l).norm(dim=-1) / ref_l.norm(dim=-1)  # [steps]
    top2 = ref_l.topk(2, dim=-1).values
    agree = ref_l.argmax(-1) == torch.tensor(fast_t)
    report("teacher-forced steps whose reference argmax is the fast path's token", agree.sum().item(), f"of {steps}")
    report("logits relative error fast vs dequantized reference, mean over steps", err.mean().item())
    report("logits relative error, max over steps", err.max().item())
    report("reference top-1 minus top-2 logit, median over steps", (top2[:, 0] - top2[:, 1]).median().item())
    if not agree.all():
        gaps = (top2[:, 0] - ref_l.gather(1, torch.tensor(fast_t)[:, None])[:, 0])[~agree]
        report("where they differ: reference top-1 minus the fast token's logit, max", gaps.max().item())


def phase_kernels(args) -> None:
    from fp8_gpu_checks import E, H, I_MOE, LINEARS, TOP_K, bench_us, linear_weights

    from armillary.kernels import fp8 as ref
    from armillary.kernels.triton import fp8_gemm, fp8_moe, fp8_scaled_mm

    dev = torch.device(args.device)
    if dev.type != "cuda":
        print("kernels phase: GPU only", flush=True)
        return
    for name, (n, k) in LINEARS.items():
        ws = linear_weights(dev, n, k)
        c = len(ws)
        for m in (128, 256, 512, 1024, 2048, 4096, 16384):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flop = 2 * m * n * k
            for label, cfg in (("Triton GEMM", dict(prefill=True, scaled_mm=False)),
                               ("cuBLAS _scaled_mm", dict(prefill=True, scaled_mm=True))):
                if cfg["scaled_mm"] and not (fp8_scaled_mm.fits(m, x, ws[0][0], ws[0][1], 128, 128, min_rows=0)
                                             and fp8_scaled_mm.ready(dev, fp8_gemm.quantize_act)):
                    print(f"fp8_linear {name} M={m} {label}: unavailable ({fp8_scaled_mm.status(dev)})", flush=True)
                    continue
                us = bench_us(lambda i, cfg=cfg: fp8_gemm.fp8_linear(x, *ws[i % c], 128, 128, config=dict(cfg)),
                              iters=max(4, c))
                report(f"fp8_linear {name} M={m} {label} us", us, f"{flop / us / 1e6:.0f} TFLOP/s")
            us = bench_us(lambda i: fp8_gemm.quantize_act(x, 128, fp8_scaled_mm.padded_rows(m)), iters=8)
            report(f"quantize_act [{m}, {k}] us", us, f"{m * k * 3 / us / 1e3:.0f} GB/s")
        dense = [ref.dequantize(q, sc, 128, 128, torch.bfloat16) for q, sc in ws]
        for m in (2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            fp8_bytes = n * k * (1 + 4 / 128 ** 2) + 2 * m * (n + k)
            for label, cfg in (("integer widening", {}), ("Triton's e4m3 cast", dict(fast_bf16=False))):
                us = bench_us(lambda i, cfg=cfg: fp8_gemm.fp8_linear(x, *ws[i % c], 128, 128, config=dict(cfg)),
                              iters=c * 4)
                report(f"fp8 skinny {name} M={m} {label} us", us, f"{fp8_bytes / us / 1e3:.0f} GB/s")
            us = bench_us(lambda i: torch.nn.functional.linear(x, dense[i % c]), iters=c * 4)
            report(f"bf16 cuBLAS {name} M={m} us", us, f"{(2 * n * k + 2 * m * (n + k)) / us / 1e3:.0f} GB/s")
        del dense, ws
    w13, s13 = ref.quantize_blocks(torch.randn(E, 2 * I_MOE, H, device=dev) * 0.02, 128, 128)
    w2, s2 = ref.quantize_blocks(torch.randn(E, H, I_MOE, device=dev) * 0.02, 128, 128)
    for t in (2048, 16384):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(t)
        routes = [torch.topk(torch.randn(t, E, device=dev, generator=gen).softmax(-1), TOP_K, dim=-1) for _ in range(4)]
        flop = 2 * t * TOP_K * 3 * H * I_MOE
        for block_m in (64, 128):
            us = bench_us(lambda j, bm=block_m: fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, 128, 128,
                                                                      *routes[j % 4], "silu", block_m=bm), 4)
            report(f"fp8_fused_moe grouped T={t} {block_m}-row tiles us", us,
                   f"{flop / us / 1e6:.0f} TFLOP/s{' (default)' if block_m == fp8_moe.grouped_block_m(t * TOP_K, True) else ''}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the driver, measures nothing real")
    ap.add_argument("--phase", default="speed")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    cfg = real_config(args.tiny)
    s = 16 if args.tiny else 1
    bw = copy_bandwidth(args.device)
    flops = fp8_matmul_flops(args.device)
    report("copy bandwidth GB/s", bw / 1e9)
    report("fp8 GEMM TFLOP/s", flops / 1e12)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        (path / "config.json").write_text(json.dumps(cfg))
        for phase in args.phase.split(","):
            if phase == "speed":
                phase_speed(path, cfg, args, bw, flops, s)
            elif phase == "kv":
                phase_kv(path, cfg, args, bw, s)
            elif phase == "logits":
                phase_logits(path, args, s)
            elif phase == "kernels":
                phase_kernels(args)
            else:
                raise SystemExit(f"unknown phase {phase!r}: speed, kv, logits, kernels")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_bench.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
