"""Every NVFP4 Triton kernel compiled offline (ptxas included) at Qwen3.6-35B-A3B sizes: the Hopper kernels for sm_90, the Blackwell scaled-dot GEMM (and the decode kernels it keeps) for sm_100 / sm_120; no GPU needed.

As bench/fp8_compile_check.py: the wrappers run on CPU tensors with ``JITFunction.run`` replaced
by a recorder, ``fp8_skinny.OFFLINE_SM_COUNT`` set and the target's tuning tables read, so they
pick what they pick on that GPU; each distinct specialisation is compiled by ``triton.compile``
for the target and checked:

- shared memory within the target's per-block opt-in limit;
- no flush-to-zero fp32 arithmetic in the unpacking kernels (the e2m1 code 0.5 decodes through
  an fp32 subnormal: ``.ftz`` would zero it);
- the decode GEMV / MoE GEMV read 16-byte vectors; the tile kernels use the tensor cores (``mma``
  / ``wgmma``), and the Blackwell GEMM a block-scaled FP4 MMA (``tcgen05.mma ... block_scale`` on
  sm_100, ``mma ... block_scale`` / ``kind::mxf4nvf4`` on sm_12x).

One line per kernel config; JSON to ``--json`` or ``$OUT/nvfp4_compile_check.json``; exit 1 on a failure.

    python bench/nvfp4_compile_check.py                       # sm_90, sm_100, sm_120, real sizes
    python bench/nvfp4_compile_check.py --quick --targets sm_90,sm_100,sm_120   # the test
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
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from armillary.kernels import tuning
from armillary.kernels.triton import fp4_blackwell, fp4_gemm, fp4_gemv, fp4_moe, fp8_skinny

H, E, TOP_K, I_MOE = 2048, 256, 8, 512
LINEARS = {"attn_qkv": (9216, H), "attn_o": (H, 4096), "gdn_in_qkvz": (12288, H), "gdn_out": (H, 4096)}
UNPACKING = {"_fp4_skinny_kernel", "_dequant_kernel", "_fp4_bf16_gemm_kernel", "_fp4_fp8_gemm_kernel",
             "_gemv_up_kernel", "_gemv_down_kernel", "_grouped_kernel", "_fp4_scaled_gemm_kernel"}


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    capability: int
    sms: int
    smem: int  # opt-in shared memory per block


TARGETS = {
    "sm_90": Target("sm_90", 90, 132, 232448),  # H100 / H200
    "sm_100": Target("sm_100", 100, 148, 232448),  # B200
    "sm_120": Target("sm_120", 120, 84, 101376),  # RTX 5090 class
    "sm_121": Target("sm_121", 121, 48, 101376),  # GB10 (DGX Spark)
}


def record_launches(target: Target, quick: bool) -> list[tuple[JITFunction, tuple, dict, str]]:
    """Run the wrappers at the model's sizes with launches recorded, not run, configured for ``target``."""
    launches = []
    where = [""]

    def record(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        launches.append((kernel, args, kwargs, where[0]))

    # the kernels the dispatch would pick there: the scaled-dot GEMM only where this Triton lowers it natively
    blackwell = fp4_blackwell.native_fp4(divmod(target.capability, 10))
    saved_run, saved_targets = JITFunction.run, tuning.device_targets
    JITFunction.run = record
    tuning.device_targets = lambda device=None: (target.name,)  # the target's tables, not "cpu"
    fp8_skinny.OFFLINE_SM_COUNT = target.sms
    fp4_blackwell.OFFLINE_NATIVE = blackwell
    try:
        linears = dict(list(LINEARS.items())[:2]) if quick else LINEARS
        for name, (n, k) in linears.items():
            w = torch.empty(n, k // 2, dtype=torch.uint8)  # never touched: no memory used
            s = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
            g = torch.ones(n)
            where[0] = f"dequantize {name}"  # the "dequant" prefill variant's unpacking (then cuBLAS)
            fp4_gemv.dequantize(w, s, g, torch.bfloat16)
            for m in ((1, 8, 64, 4096) if not quick else (1, 8, 4096)):
                x = torch.zeros(m, k, dtype=torch.bfloat16)
                if blackwell:
                    where[0] = f"blackwell {name} M={m}"
                    fp4_blackwell.fp4_linear(x, w, s, g)
                    continue
                variants = ("bf16", "fp8") if m > fp4_gemm.DECODE_MAX_ROWS else ("bf16",)
                for variant in variants:
                    where[0] = f"fp4_linear {name} M={m} {variant if m > 64 else ''}"
                    fp4_gemm.fp4_linear(x, w, s, g, config=dict(variant=variant))
        w13 = torch.empty(E, 2 * I_MOE, H // 2, dtype=torch.uint8)
        s13 = torch.empty(E, 2 * I_MOE, H // 16, dtype=torch.float8_e4m3fn)
        w2 = torch.empty(E, H, I_MOE // 2, dtype=torch.uint8)
        s2 = torch.empty(E, H, I_MOE // 16, dtype=torch.float8_e4m3fn)
        g13, g2 = torch.ones(E, 2 * I_MOE), torch.ones(E, H)
        where[0] = "dequantize experts"
        fp4_gemv.dequantize(w13, s13, g13, torch.bfloat16)
        for t in ((1, 8) if quick else (1, 4, 8, 64, 2048)):
            where[0] = f"fp4_fused_moe T={t}"
            ids = torch.randperm(E)[: t * TOP_K].view(t, TOP_K) if t * TOP_K <= E else torch.randint(0, E, (t, TOP_K))
            fp4_moe.fp4_fused_moe(torch.zeros(t, H, dtype=torch.bfloat16), w13, s13, g13, w2, s2, g2,
                                  torch.rand(t, TOP_K), ids, "silu", grouped=(t > 1 and quick) or None)
    finally:
        JITFunction.run, tuning.device_targets = saved_run, saved_targets
        fp8_skinny.OFFLINE_SM_COUNT = None
        fp4_blackwell.OFFLINE_NATIVE = False
    return [launch for launch in launches if launch[0].fn.__name__ != "_count_and_rank_kernel"
            and launch[0].fn.__name__ != "_scatter_kernel"]


def _name(fn: JITFunction, key) -> str:
    return fn.arg_names[key[0]] if isinstance(key, tuple) else str(key)


def _properties(ptx: str) -> dict:
    return dict(wide_loads=len(re.findall(r"ld\.global\S*\.v4\.(?:b32|u32|f32)", ptx)),
                cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)|cp\.async\.bulk", ptx)),
                mma=len(re.findall(r"\bmma\.sync|wgmma\.mma_async|tcgen05\.mma", ptx)),
                wgmma_e4m3=len(re.findall(r"wgmma\.mma_async[^\n]*e4m3", ptx)),
                fp4_mma=len(re.findall(r"(?:tcgen05\.mma|mma\.sync)[^\n]*(?:block_scale|mxf4nvf4|e2m1)", ptx)),
                ftz=len(re.findall(r"\b(?:mul|fma|add|sub)\.(?:rn\.)?ftz\.f32", ptx)),
                l2_prefetch=len(re.findall(r"prefetch\.global\.L2|cp\.async\.bulk\.prefetch\.L2", ptx)))


def compile_all(target: Target, launches) -> list[dict]:
    gpu_target = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu_target)
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
        row = dict(target=target.name, kernel=fn.fn.__name__, where=where, num_warps=options.num_warps,
                   num_stages=options.num_stages,
                   constexprs={_name(fn, k): v for k, v in constexprs.items() if isinstance(v, (int, bool, str))})
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu_target,
                                      options=options.__dict__)
            row.update(shared=int(compiled.metadata.shared), **_properties(compiled.asm["ptx"]))
            row["ok"] = row["shared"] <= target.smem
            if not row["ok"]:
                row["error"] = f"shared memory {row['shared']} over {target.smem}"
            elif fn.fn.__name__ in UNPACKING and row["ftz"]:  # the subnormal e2m1 0.5 must survive
                row.update(ok=False, error=f"{row['ftz']} flush-to-zero fp32 instructions")
        except Exception as exc:  # a compile error is the finding: report it and go on
            row.update(shared=-1, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{target.name:6s} {row['kernel']:24s} {where:34s} warps {row['num_warps']} stages {row['num_stages']}: "
              f"shared {row['shared']:7d} / {target.smem}, 16-byte loads {row.get('wide_loads', 0)}, cp.async "
              f"{row.get('cp_async', 0)}, mma {row.get('mma', 0)} (fp8 wgmma {row.get('wgmma_e4m3', 0)}, fp4 "
              f"{row.get('fp4_mma', 0)}), ftz {row.get('ftz', 0)} "
              f"{'ok' if row['ok'] else 'FAIL ' + row.get('error', '')[:300]}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per kernel path")
    ap.add_argument("--targets", default="sm_90,sm_100,sm_120", help=f"comma list of {sorted(TARGETS)}")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}", flush=True)
    rows = []
    for name in args.targets.split(","):
        target = TARGETS[name.strip()]
        rows += compile_all(target, record_launches(target, args.quick))
    path = args.json or (os.path.join(os.environ["OUT"], "nvfp4_compile_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(rows, indent=1))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
