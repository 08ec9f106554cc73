"""GPU checks of the NVFP4 kernels at Qwen3.6-35B-A3B sizes against the dequantizing reference; one line per check, JSON to $OUT, exit 1 on a failure.

``fp4_linear`` per projection shape: the skinny decode GEMM at 1 / 8 / 64 rows, the three prefill
variants (bf16 dequantized tile; fp8 re-rounded tile with e4m3 activations; whole weight unpacked
then cuBLAS) at 4096 rows, and on
capability 10+ the native W4A4 scaled-dot GEMM (its activation quantizer bit-equal to the
reference's); ``fp4_fused_moe`` GEMV (1 / 4 / 8 tokens) and grouped (64 / 2048 tokens); the split-K
ticket reset (two calls equal) and the dispatch's choice of ``fp4_linear`` on this GPU. Weights are
random, quantized on the GPU by ``armillary.kernels.fp4.quantize_nvfp4``.

    python bench/nvfp4_gpu_checks.py
    TRITON_INTERPRET=1 python bench/nvfp4_gpu_checks.py --smoke   # CPU, small sizes: the driver itself
"""
from __future__ import annotations

import json
import os
import sys

import torch

from armillary.kernels import fp4 as ref
from armillary.kernels.triton import fp4_blackwell, fp4_gemm, fp4_gemv, fp4_moe

H, I_MOE, E, TOP_K = 2048, 512, 256, 8
SMOKE = "--smoke" in sys.argv
ACT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong; fp16 stands in
LINEARS = {"attn_qkv": (8192 + 2 * 512, H), "attn_o": (H, 4096), "gdn_in_qkvz": (12288, H), "gdn_out": (H, 4096)}


def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def nvfp4_weight(n: int, k: int, dev: torch.device, lead: tuple[int, ...] = ()):
    """Random weight ~N(0, 0.02) as NVFP4 (packed, scales, row global scales)."""
    w = torch.randn(*lead, n, k, device=dev) * 0.02
    packed, scale, g = ref.quantize_nvfp4(w)
    return packed, scale, ref.row_global_scale(g, n).to(dev)


def report(results: list, check: str, passed: bool, line: str, **fields) -> bool:
    results.append(dict(check=check, ok=passed, **fields))
    print(f"{line} {'ok' if passed else 'FAIL'}", flush=True)
    return passed


def linear_checks(dev: torch.device, results: list) -> bool:
    ok = True
    linears = {"attn_o": (96, 160)} if SMOKE else LINEARS
    for name, (n, k) in linears.items():
        packed, scale, g = nvfp4_weight(n, k, dev)
        for m in ((1, 3, 70) if SMOKE else (1, 8, 64, 4096)):
            x = torch.randn(m, k, device=dev, dtype=ACT)
            want = ref.linear(x.float(), packed, scale, g, None)
            if m <= fp4_gemv.DECODE_MAX_ROWS:
                out = fp4_gemm.fp4_linear(x, packed, scale, g)
                again = fp4_gemm.fp4_linear(x, packed, scale, g)  # split-K tickets reset between calls
                err = ratio(out, want)
                same = torch.equal(out, again)
                ok &= report(results, f"fp4 skinny {name} M={m}", err < 1e-2 and same,
                             f"fp4 skinny {name:12s} M={m:5d} N={n} K={k}: err {err:.2e}, repeat bit-equal {same}",
                             err=err, repeat_equal=same)
                continue
            for variant, tol in (("bf16", 1e-2), ("fp8", 6e-2), ("dequant", 1e-2)):  # fp8: e4m3 activations
                out = fp4_gemm.fp4_linear(x, packed, scale, g, config=dict(variant=variant))
                err = ratio(out, want)
                ok &= report(results, f"fp4 prefill {variant} {name} M={m}", err < tol,
                             f"fp4 prefill {variant:4s} {name:12s} M={m:5d} N={n} K={k}: err {err:.2e} (< {tol})",
                             err=err)
            ok &= blackwell_check(dev, results, name, x, packed, scale, g, want)
    return ok


def blackwell_check(dev, results, name, x, packed, scale, g, want) -> bool:
    """The W4A4 scaled-dot GEMM where this GPU has FP4 MMA (skipped with a line elsewhere)."""
    if dev.type == "cuda" and not fp4_blackwell.supports(dev, None):
        print(f"fp4 blackwell {name}: skipped (capability {torch.cuda.get_device_capability(dev)} has no FP4 MMA "
              f"this Triton drives)", flush=True)
        return True
    q, s, xg = fp4_blackwell.quantize_act_nvfp4(x)
    q2, s2, xg2 = ref.quantize_nvfp4(x.float()[:, None, :])
    exact = torch.equal(q, q2[:, 0]) and torch.equal(s.view(torch.uint8), s2[:, 0].view(torch.uint8))
    w4a4 = ref.dequantize(q2[:, 0], s2[:, 0], xg2) @ ref.dequantize(packed, scale, g).T
    out = fp4_blackwell.fp4_linear(x, packed, scale, g)
    err, err_w16 = ratio(out, w4a4), ratio(out, want)
    return report(results, f"fp4 blackwell {name} M={x.shape[0]}", exact and err < 1e-2 and err_w16 < 0.2,
                  f"fp4 blackwell {name:12s} M={x.shape[0]:5d}: act quantizer bit-equal {exact}, err vs W4A4 "
                  f"{err:.2e}, vs weight-only {err_w16:.2e}", err=err, err_weight_only=err_w16, quantizer_exact=exact)


def moe_checks(dev: torch.device, results: list) -> bool:
    ok = True
    e, h, i = (6, 96, 64) if SMOKE else (E, H, I_MOE)
    top_k = 2 if SMOKE else TOP_K
    w13 = nvfp4_weight(2 * i, h, dev, (e,))
    w2 = nvfp4_weight(h, i, dev, (e,))
    for t in ((1, 40) if SMOKE else (1, 4, 8, 64, 2048)):
        x = torch.randn(t, h, device=dev, dtype=ACT)
        weights, ids = torch.topk(torch.randn(t, e, device=dev).softmax(-1), top_k, dim=-1)
        grouped = t * top_k > fp4_moe.GEMV_MAX_PAIRS
        want = ref.fused_moe(x.float(), *w13, *w2, weights, ids, "silu")
        for path in ((None, "dequant") if grouped else (None,)):
            out = fp4_moe.fp4_fused_moe(x, *w13, *w2, weights, ids, "silu", grouped=path)
            err = ratio(out, want)
            label = path or ("grouped" if grouped else "gemv")
            ok &= report(results, f"fp4_fused_moe T={t} {label}", err < 2e-2,
                         f"fp4_fused_moe T={t:5d} ({label}): err {err:.2e}", err=err)
    return ok


def dispatch_check(dev: torch.device, results: list) -> bool:
    """Which implementation the engine's dispatch picks for fp4_linear / fp4_fused_moe on this device."""
    from armillary.kernels.dispatch import resolve_dispatch
    from armillary.registry import PluginRegistry

    table = resolve_dispatch(PluginRegistry(), None, dev, "auto" if dev.type == "cuda" else "triton")
    chosen = {name: table.chosen(name) for name in ("fp4_linear", "fp4_fused_moe")}
    want_linear = "triton_fp4_linear_blackwell" if dev.type == "cuda" and fp4_blackwell.supports(dev, None) \
        else "triton_fp4_linear"
    passed = chosen["fp4_linear"] == want_linear and chosen["fp4_fused_moe"] == "triton_fp4_fused_moe"
    return report(results, "dispatch", passed, f"dispatch on {dev}: {chosen} (want fp4_linear {want_linear})",
                  **chosen)


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    torch.manual_seed(0)
    results: list = []
    ok = linear_checks(dev, results)
    ok &= moe_checks(dev, results)
    ok &= dispatch_check(dev, results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "nvfp4_gpu_checks.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"nvfp4 gpu checks: {sum(r['ok'] for r in results)} / {len(results)} ok", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
