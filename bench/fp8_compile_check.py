"""Every fp8 Triton kernel compiled offline for sm_90 (ptxas included) at Qwen3.6-35B-A3B sizes, with the GPU launch configs; no GPU needed.

The fp8 wrappers (``fp8_linear`` decode / prefill, ``fp8_fused_moe`` GEMV / grouped, the KV store)
are called on CPU tensors with ``JITFunction.run`` replaced by a recorder and
``fp8_skinny.OFFLINE_SM_COUNT`` set, so they choose what they choose on an H200; each distinct
specialisation is then compiled to a cubin by ``triton.compile`` for GPUTarget("cuda", 90, 32)
and its shared memory compared with the 227 KB an sm_90 block may use. Compile errors and
shared-memory overruns show up here instead of on the GPU. One line per kernel config; JSON to
``--json`` or ``$OUT/fp8_compile_check.json``; exit 1 on any failure.

    python bench/fp8_compile_check.py            # real sizes
    python bench/fp8_compile_check.py --quick    # one shape per kernel path (the test)
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from armillary.kernels.triton import fp8_gemm, fp8_moe, fp8_skinny, kv_cache
from armillary.kernels.triton.moe_align import moe_align

SM90 = GPUTarget("cuda", 90, 32)
SM90_SMEM = 232448  # opt-in shared memory per block on H100 / H200
H, E, TOP_K, I_MOE = 2048, 256, 8, 512
EXACT_KERNELS = {"_write_kv_kernel", "_quant_act_kernel"}  # bit-equal to torch's stores / quantizer
LINEARS = {"attn_qkv": (9216, H), "attn_o": (H, 4096), "gdn_in_qkvz": (12288, H), "gdn_out": (H, 4096)}


def record_launches(quick: bool) -> list[tuple[JITFunction, tuple, dict, str]]:
    """Run the wrappers at the model's sizes with launches recorded, not run."""
    launches = []
    where = [""]

    def record(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        launches.append((kernel, args, kwargs, where[0]))

    saved = JITFunction.run
    JITFunction.run = record
    fp8_skinny.OFFLINE_SM_COUNT = 132
    try:
        linears = dict(list(LINEARS.items())[:2]) if quick else LINEARS
        for name, (n, k) in linears.items():
            w = torch.empty(n, k, dtype=torch.float8_e4m3fn)  # never touched: no memory used
            s = torch.ones(triton.cdiv(n, 128), triton.cdiv(k, 128))
            for m in ((1, 8, 64, 4096) if not quick else (1, 8, 4096)):
                where[0] = f"fp8_linear {name} M={m}"
                fp8_gemm.fp8_linear(torch.zeros(m, k, dtype=torch.bfloat16), w, s, 128, 128)
        w13 = torch.empty(E, 2 * I_MOE, H, dtype=torch.float8_e4m3fn)
        s13 = torch.ones(E, 2 * I_MOE // 128, H // 128)
        w2 = torch.empty(E, H, I_MOE, dtype=torch.float8_e4m3fn)
        s2 = torch.ones(E, H // 128, I_MOE // 128)
        for t in ((1, 8, 9) if quick else (1, 4, 8, 64, 2048, 16384)):
            where[0] = f"fp8_fused_moe T={t}"
            ids = torch.randperm(E)[: t * TOP_K].remainder(E).view(t, TOP_K) if t * TOP_K <= E else \
                torch.randint(0, E, (t, TOP_K))
            fp8_moe.fp8_fused_moe(torch.zeros(t, H, dtype=torch.bfloat16), w13, s13, w2, s2, 128, 128,
                                  torch.rand(t, TOP_K), ids, "silu", grouped=t > 1 and quick or None,
                                  block_m=128 if quick and t == 9 else None)  # 9: the 128-row 8-warp tiles
        where[0] = "moe_align one program T=64"  # a 64-stream decode step's pairs (8 routed + 1 shared)
        moe_align(torch.randint(0, E, (64, TOP_K + 1), dtype=torch.int32), E + 1, 16, one_program=True)
        where[0] = "fp8 KV store"
        kv = torch.empty(64, 16, 2, 256, dtype=torch.float8_e4m3fn)
        x = torch.zeros(4, 2, 256, dtype=torch.bfloat16)
        kv_cache.write_kv_cache(x, x, kv, kv, torch.arange(4), torch.ones(()), torch.ones(()))
    finally:
        JITFunction.run = saved
        fp8_skinny.OFFLINE_SM_COUNT = None
    return launches


def _name(fn: JITFunction, key) -> str:
    """A constexpr's parameter name (Triton keys them by argument index paths)."""
    return fn.arg_names[key[0]] if isinstance(key, tuple) else str(key)


def compile_all(launches) -> list[dict]:
    backend = make_backend(SM90)
    rows, seen = [], set()
    for fn, args, kwargs, where in launches:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
        key = repr((fn.fn.__qualname__, sorted(signature.items()), sorted(constexprs.items()),
                    sorted(attrs.items()), sorted(options.__dict__.items())))
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        row = dict(kernel=fn.fn.__name__, where=where, num_warps=options.num_warps, num_stages=options.num_stages,
                   constexprs={_name(fn, k): v for k, v in constexprs.items() if isinstance(v, (int, bool, str))})
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90,
                                      options=options.__dict__)
            ptx = compiled.asm["ptx"]
            row.update(shared=int(compiled.metadata.shared), ok=int(compiled.metadata.shared) <= SM90_SMEM,
                       wide_loads=len(re.findall(r"ld\.global\S*\.v4\.b32", ptx)),  # 16-byte loads
                       cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)|cp\.async\.bulk", ptx)),
                       wgmma_e4m3=len(re.findall(r"wgmma\.mma_async[^\n]*e4m3", ptx)),
                       mma=len(re.findall(r"\bmma\.sync|wgmma\.mma_async", ptx)),
                       l2_prefetch=len(re.findall(r"prefetch\.global\.L2|cp\.async\.bulk\.prefetch\.L2", ptx)),
                       barriers=len(re.findall(r"\bbar\.sync|barrier\.sync", ptx)),
                       atomics=len(re.findall(r"\batom\.global|\bred\.global", ptx)),
                       approx_div=len(re.findall(r"div\.(?:full|approx)(?:\.ftz)?\.f32", ptx)),
                       sign_flips=len(re.findall(r"neg\.f32|sub(?:\.ftz)?\.f32\s+%\w+,\s*0f00000000,", ptx)))
            if fn.fn.__name__ in EXACT_KERNELS and row["approx_div"]:  # must round as torch: IEEE divisions only
                row.update(ok=False, error=f"{row['approx_div']} approximate fp32 divisions")
            if fn.fn.__name__ in EXACT_KERNELS and row["sign_flips"]:  # 0 - r loses -0: the sign goes in as a bit
                row.update(ok=False, error=f"{row['sign_flips']} float negations (torch keeps the sign of zero)")
        except Exception as exc:  # a compile error is the finding: report it and go on
            row.update(shared=-1, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{row['kernel']:24s} {where:28s} warps {row['num_warps']} stages {row['num_stages']}: shared "
              f"{row['shared']:7d} / {SM90_SMEM}, 16-byte loads {row.get('wide_loads', 0)}, cp.async "
              f"{row.get('cp_async', 0)}, mma {row.get('mma', 0)} (fp8 wgmma {row.get('wgmma_e4m3', 0)}) {'ok' if row['ok'] else 'FAIL ' + row.get('error', 'over')[:200]}",
              flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per kernel path")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = compile_all(record_launches(args.quick))
    path = args.json or (os.path.join(os.environ["OUT"], "fp8_compile_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(rows, indent=1))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
