"""GPU checks of the fp8 kernels at Qwen3.6-35B-A3B sizes against the dequantizing references; one line per check, JSON to $OUT.

fp8 linear (skinny decode and block-scaled prefill with the fused activation quantization) per
projection shape and row count, the fp8 fused MoE (GEMV and grouped), the fp8 KV store and decode
attention over fp8 pages at 32K context. Exit status 1 on any failure.

    python bench/fp8_gpu_checks.py
    TRITON_INTERPRET=1 python bench/fp8_gpu_checks.py --smoke   # CPU, small sizes: the driver itself
"""
from __future__ import annotations

import json
import os
import sys

import torch

from armillary.kernels import fp8 as ref
from armillary.kernels.triton import fp8_gemm, fp8_moe

H, I_MOE, E, TOP_K = 2048, 512, 256, 8
SMOKE = "--smoke" in sys.argv  # CPU (TRITON_INTERPRET=1), small sizes: checks the driver itself
ACT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 tl.dot is broken; fp16 stands in
LINEARS = {"attn_qkv": (8192 + 2 * 512, H), "attn_o": (H, 4096), "gdn_in_qkvz": (12288, H), "gdn_out": (H, 4096)}


def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_us(fn, iters: int = 50) -> float:
    """Mean µs per call of ``fn(i)`` (i: which weight copy) replayed from one CUDA graph of ``iters``
    calls: no Python launch cost in the figure (the engine decodes from graphs too)."""
    if not torch.cuda.is_available():
        return float("nan")  # the CPU smoke run times nothing
    for i in range(3):
        fn(i)  # compiles, sizes the ticket buffer outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(i)
        run = graph.replay
    except RuntimeError as exc:  # a path that syncs with the host: timed eagerly (launch costs included)
        print(f"  (not graph-capturable, timed eagerly: {str(exc)[:120]})", flush=True)
        torch.cuda.synchronize()

        def run():
            for i in range(iters):
                fn(i)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iters)


def copies_for(nbytes: int) -> int:
    """Weight copies rotated through so that a timing streams from HBM, not from the 50 MB L2."""
    return 1 if SMOKE else max(2, -(-256 * 2 ** 20 // max(nbytes, 1)))


def scaled_mm_blockwise(x: torch.Tensor, wq: torch.Tensor, s: torch.Tensor):
    """torch._scaled_mm with 1 x 128 activation and 128 x 128 weight scales (cuBLASLt block scaling,
    where this torch has it): (a callable, the scale layout taken) or (None, why not). Informational:
    a faster prefill GEMM than the Triton one if it exists here."""
    xq, xs = fp8_gemm.quantize_act(x, 128)  # xs [K / 128, M]: .t() is the column-major [M, K / 128]
    last = "no layout tried"
    for label, b_s in (("[K/128, N/128]", s.t()), ("[N/128, K/128]", s), ("[K/128, N/128] contiguous", s.t().contiguous())):
        call = lambda b_s=b_s: torch._scaled_mm(xq, wq.t(), scale_a=xs.t(), scale_b=b_s,  # noqa: E731
                                                out_dtype=torch.bfloat16)
        try:
            call()
            return call, label
        except (RuntimeError, ValueError, TypeError) as exc:
            last = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None, last


def kv_checks(dev: torch.device, results: list, ctx: int = 32768) -> bool:
    """fp8 KV store (bit-equal to the torch store) and decode attention over fp8 pages at 32K context."""
    from armillary.forward_batch import KVCache
    from armillary.kernels import attention as ref_attn
    from armillary.kernels.triton import kv_cache, paged_attention

    ok, bs, hq, hkv, d, batch = True, 16, 16, 2, 256, 4
    blocks = batch * ctx // bs + 1
    caches = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        k = torch.zeros(blocks, bs, hkv, d, dtype=dtype, device=dev)
        scales = (torch.full((), 0.05, device=dev), torch.full((), 0.02, device=dev)) if name == "fp8" else (None, None)
        caches[name] = KVCache(k, torch.zeros_like(k), 0, *scales)
    tables = torch.arange(1, blocks, dtype=torch.int32, device=dev).view(batch, -1)
    slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(-1)  # [B * ctx]
    keys = torch.randn(batch * ctx, hkv, d, device=dev, dtype=ACT)
    vals = torch.randn(batch * ctx, hkv, d, device=dev, dtype=ACT)
    ref_fp8 = KVCache(torch.zeros_like(caches["fp8"].k), torch.zeros_like(caches["fp8"].v), 0,
                      caches["fp8"].k_scale, caches["fp8"].v_scale)
    ref_attn.write_kv(ref_fp8, keys, vals, slots)
    for name, c in caches.items():
        kv_cache.write_kv_cache(keys, vals, c.k, c.v, slots, c.k_scale, c.v_scale)
    diff = int((ref_fp8.k.view(torch.uint8) != caches["fp8"].k.view(torch.uint8)).sum()
               + (ref_fp8.v.view(torch.uint8) != caches["fp8"].v.view(torch.uint8)).sum())
    same = diff == 0
    ok &= same
    results.append(dict(check="fp8 KV store bit-equal to the torch store", bytes_differing=diff, ok=same))
    print(f"fp8 KV store vs torch store: {'bit-equal ok' if same else f'FAIL ({diff} bytes differ)'}", flush=True)
    q = torch.randn(batch, hq, d, device=dev, dtype=ACT)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    outs, times = {}, {}
    for name, c in caches.items():
        run = lambda i=0, c=c: paged_attention.paged_attention_decode(q, c.k, c.v, tables, lens, d ** -0.5,  # noqa: E731
                                                                 max_seq_len=ctx, k_scale=c.k_scale,
                                                                 v_scale=c.v_scale)
        outs[name], times[name] = run(), bench_us(run)
    want = ref_attn.paged_attention(q, ref_fp8, tables, list(range(batch + 1)), [ctx] * batch, d ** -0.5)
    err = ratio(outs["fp8"], want)
    vs_bf16 = ratio(outs["fp8"], outs["bf16"])
    passed = err < 1e-2 and vs_bf16 < 0.1
    ok &= passed
    results.append(dict(check="fp8 KV decode attention 32K", err=err, vs_bf16=vs_bf16, us_fp8=times["fp8"],
                        us_bf16=times["bf16"], ok=passed))
    print(f"decode attention over fp8 KV, 4 x 32K: err vs reference {err:.2e}, vs bf16 KV {vs_bf16:.2e}; "
          f"{times['fp8']:.1f} us (bf16 KV {times['bf16']:.1f} us) {'ok' if passed else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    smoke = SMOKE
    dev = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    results, ok = [], True
    linears = {"attn_o": (256, 384)} if smoke else LINEARS
    probes = []
    for name, (n, k) in linears.items():
        copies = copies_for(n * k)
        ws = [ref.quantize_blocks(torch.randn(n, k, device=dev) * 0.02, 128, 128) for _ in range(min(copies, 2))]
        ws = [ws[i % len(ws)] if i < 2 else (ws[i % 2][0].clone(), ws[i % 2][1].clone()) for i in range(copies)]
        wq, s = ws[0]
        dense = [ref.dequantize(q, sc, 128, 128, ACT) for q, sc in ws[:copies]] if not smoke else []
        for m in ((1, 40, 70) if smoke else (1, 8, 64, 4096)):
            x = torch.randn(m, k, device=dev, dtype=ACT)
            out = fp8_gemm.fp8_linear(x, wq, s, 128, 128)
            want = ref.linear(x, wq, s, 128, 128, None) if m <= fp8_gemm.DECODE_MAX_ROWS else \
                ref.linear_w8a8(x, wq, s, 128, 128, None)
            err = ratio(out, want)
            us = bench_us(lambda i: fp8_gemm.fp8_linear(x, *ws[i % copies], 128, 128), iters=copies * 4)
            gbs = (n * k + m * k * 2 + m * n * 2) / us / 1e3
            tflops = 2 * m * n * k / us / 1e6
            base = bench_us(lambda i: torch.nn.functional.linear(x, dense[i % copies]), iters=copies * 4) \
                if dense else float("nan")  # bf16 cuBLAS on the dequantized weight: the speed fp8 must beat
            passed = err < (1e-2 if m <= fp8_gemm.DECODE_MAX_ROWS else 2e-2) * (3 if smoke else 1)
            ok &= passed
            results.append(dict(check=f"fp8_linear {name} M={m}", err=err, us=us, gb_s=gbs, tflop_s=tflops,
                                bf16_cublas_us=base, ok=passed))
            print(f"fp8_linear {name:12s} M={m:5d} N={n} K={k}: err {err:.2e} {us:8.1f} us {gbs:7.0f} GB/s "
                  f"{tflops:7.1f} TFLOP/s; bf16 cuBLAS {base:8.1f} us {'ok' if passed else 'FAIL'}", flush=True)
            if m >= 1024 and not smoke and name == "attn_qkv":
                probes.append((name, m, x, wq, s, want, us))  # after every other check: a cuBLAS fault is sticky
        del dense
    e, h, i = (8, 256, 128) if smoke else (E, H, I_MOE)
    w13, s13 = ref.quantize_blocks(torch.randn(e, 2 * i, h, device=dev) * 0.02, 128, 128)
    w2, s2 = ref.quantize_blocks(torch.randn(e, h, i, device=dev) * 0.02, 128, 128)
    for t in ((1, 20) if smoke else (1, 4, 8, 64, 2048)):
        x = torch.randn(t, h, device=dev, dtype=ACT)
        gen = torch.Generator(device=dev).manual_seed(t)
        routes = [torch.topk(torch.randn(t, e, device=dev, generator=gen).softmax(-1), TOP_K, dim=-1)
                  for _ in range(1 if smoke else 16)]  # 16 routings: timings stream other experts, not L2
        weights, ids = routes[0]
        grouped = t * TOP_K > fp8_moe.GEMV_MAX_PAIRS
        out = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, 128, 128, weights, ids, "silu")
        want = ref.fused_moe(x, w13, s13, w2, s2, 128, 128, weights, ids, "silu", quantize_input=grouped)
        err = ratio(out, want)
        us = bench_us(lambda j: fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, 128, 128, *routes[j % len(routes)],
                                                      "silu"), 16)
        touched = len(torch.unique(ids))
        gbs = touched * 3 * h * i / us / 1e3
        passed = err < (3e-2 if smoke else 2e-2)  # the interpreter truncates bf16 stores
        ok &= passed
        results.append(dict(check=f"fp8_fused_moe T={t}", err=err, us=us, gb_s=gbs, ok=passed))
        print(f"fp8_fused_moe T={t:5d} ({'grouped' if grouped else 'gemv'}): err {err:.2e} {us:8.1f} us "
              f"({touched} experts, {gbs:6.0f} GB/s) {'ok' if passed else 'FAIL'}", flush=True)
    ok &= kv_checks(dev, results, 64 if smoke else 32768)
    for name, m, x, wq, s, want, us in probes:
        call, label = scaled_mm_blockwise(x, wq, s)
        if call is None:
            print(f"torch._scaled_mm block-scaled {name} M={m}: unavailable ({label})", flush=True)
            continue
        mm_err = ratio(call(), want)
        mm_us = bench_us(lambda i: call(), iters=8)
        results.append(dict(check=f"_scaled_mm blockwise {name} M={m}", err=mm_err, us=mm_us, scale_b=label))
        print(f"torch._scaled_mm block-scaled {name} M={m} (scale_b {label}): err {mm_err:.2e} {mm_us:8.1f} us "
              f"vs the Triton GEMM {us:8.1f} us (with its quantization pass)", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_gpu_checks.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
