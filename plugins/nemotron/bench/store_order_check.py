"""Write-after-read order of the Mamba kernels' in-place updates (fused decode step, SSD scan), checked in their sm_90 TTGIR (offline, no GPU).

The decode kernel rewrites the conv windows and SSM states it reads, the scan the SSM states. On
the GPU one element may be held by several threads (a vector broadcast over a tile lives in every
warp), and the compiler gives loads and stores layouts of their own, so a store can overwrite an
element another thread has yet to load; the CPU interpreter runs each op on whole tensors and never
shows it. The rule checked here: every ``tt.store`` through a pointer derived from ``conv_ptr`` or
``states_ptr`` has a barrier between it and every earlier ``tt.load`` through a pointer derived
from the same argument (conservative: the barriers Triton adds later for layout conversions do not
count). Compiled at the Nano bf16 and tiny / odd fp32 shapes for each ``num_warps`` (layouts depend on it).

    python plugins/nemotron/bench/store_order_check.py [--warps 2,4,8,16] [--json out.json]

Exits 1 when a launch breaks the rule.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import smem_check as core_check  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary_nemotron.ops.mamba.decode import mamba_decode_step  # noqa: E402
from armillary_nemotron.ops.mamba.ssd_scan import ssd_chunk_scan  # noqa: E402

IN_PLACE = ("conv_ptr", "states_ptr", "contrib_ptr")  # contrib_ptr: the chunked scan's hand-over rewrites it
# name, dtype, heads, head_dim, groups, state, conv kernel
SHAPES = [("nano-bf16", torch.bfloat16, 64, 64, 8, 128, 4), ("tiny-fp32", torch.float32, 4, 8, 2, 16, 4),
          ("odd-fp32", torch.float32, 6, 20, 3, 24, 3)]
WARPS = (2, 4, 8, 16)
_SSA = re.compile(r"%[\w.$-]+")
_LOC = re.compile(r"\s*loc\(.*$")


def _launch(dtype, heads: int, p: int, groups: int, n: int, kw: int, warps: int) -> None:
    d_inner, conv_dim = heads * p, heads * p + 2 * groups * n
    proj = torch.empty(2, d_inner + conv_dim + heads, dtype=dtype)
    z, xbc, dt = proj.split([d_inner, conv_dim, heads], dim=-1)
    mamba_decode_step(xbc, z, dt, torch.empty(conv_dim, kw, dtype=dtype), torch.empty(conv_dim, dtype=dtype),
                      torch.empty(3, conv_dim, kw - 1, dtype=dtype), torch.empty(heads), torch.empty(heads),
                      torch.empty(heads), 1e-3, torch.empty(d_inner, dtype=dtype), 1e-5,
                      torch.empty(3, heads, p, n), torch.arange(2), heads, p, config={"num_warps": warps, "split_p": 0})
    for split in (4, 16):  # the row split: programs per head and block of state rows, tickets for B / C
        mamba_decode_step(xbc, z, dt, torch.empty(conv_dim, kw, dtype=dtype), torch.empty(conv_dim, dtype=dtype),
                          torch.empty(3, conv_dim, kw - 1, dtype=dtype), torch.empty(heads), torch.empty(heads),
                          torch.empty(heads), 1e-3, torch.empty(d_inner, dtype=dtype), 1e-5,
                          torch.empty(3, heads, p, n), torch.arange(2), heads, p,
                          config={"num_warps": warps, "split_p": split})
    x, B, C = xbc.split([d_inner, groups * n, groups * n], dim=-1)
    ssd_chunk_scan(x, B, C, dt, torch.empty(heads), torch.empty(heads), torch.empty(heads), 1e-3,
                   torch.zeros(3, dtype=torch.int32), torch.empty(3, heads, p, n), torch.arange(2), heads, p,
                   config={"num_warps": warps})
    ssd_chunk_scan(x, B, C, dt, torch.empty(heads), torch.empty(heads), torch.empty(heads), 1e-3,
                   torch.zeros(3, dtype=torch.int32), torch.empty(3, heads, p, n), torch.arange(2), heads, p,
                   config={"num_warps": warps, "pass_warps": warps, "chunked_min_tokens": 0})  # the chunked path


def ttgir(job: core_check.CompileJob) -> str:
    """The launch's module after Triton's TTGIR stage, as text."""
    target = GPUTarget("cuda", job.target.capability, 32)
    backend = make_backend(target)
    options = backend.parse_options(job.options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(job.kernel, job.signature, job.constexprs, job.attrs)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    metadata = {"target": target, **options.__dict__}
    return str(stages["ttgir"](stages["ttir"](module, metadata), metadata))


def unordered_stores(text: str, args: tuple[str, ...] = IN_PLACE) -> list[str]:
    """Stores through ``args`` that no barrier separates from an earlier load through the same argument."""
    derived = {a: {f"%{a}"} for a in args}
    loaded = {a: False for a in args}
    bad: list[str] = []
    for raw in text.splitlines():
        line = _LOC.sub("", raw).strip()
        if re.match(r"(ttg|gpu)\.barrier\b", line):
            loaded = dict.fromkeys(args, False)
            continue
        lhs, eq, rhs = line.partition(" = ")
        if not eq:
            lhs, rhs = "", line
        op = rhs.split(" ", 1)[0].strip('"')
        operands = _SSA.findall(rhs.split(" : ", 1)[0])
        for a in args:
            if op == "tt.load" and operands and operands[0] in derived[a]:
                loaded[a] = True
            elif op == "tt.store" and operands and operands[0] in derived[a]:
                if loaded[a]:
                    bad.append(f"{a}: {line[:160]}")
            elif lhs and op != "tt.load" and "!tt.ptr" in rhs and any(o in derived[a] for o in operands):
                derived[a].update(_SSA.findall(lhs.split(":")[0]))
    return bad


def check(target_name: str = "sm_90", warp_counts: tuple[int, ...] = WARPS) -> list[dict]:
    target = core_check.TARGETS[target_name]
    rows = []
    for name, dtype, heads, p, groups, n, kw in SHAPES:
        for warps in warp_counts:
            with core_check.recording(target) as (launches, where):
                tuning.use_packages(("armillary_nemotron",))
                _launch(dtype, heads, p, groups, n, kw, warps)
            jobs: dict[str, core_check.CompileJob] = {}
            core_check.compile_jobs(launches, target, name, jobs)
            for job in jobs.values():
                text = ttgir(job)
                bad = unordered_stores(text)
                rows.append(dict(target=target_name, shapes=name, num_warps=warps, kernel=job.kernel.fn.__name__,
                                 stores=sum("tt.store %" in ln for ln in text.splitlines()),
                                 barriers=len(re.findall(r"(ttg|gpu)\.barrier\b", text)), unordered=bad))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--warps", default=",".join(map(str, WARPS)))
    ap.add_argument("--json", default=None, help="write the rows as JSON here ('-' for stdout)")
    args = ap.parse_args()
    rows = check(args.target, tuple(int(w) for w in args.warps.split(",")))
    if args.json == "-":
        print(json.dumps(rows))
    else:
        for r in rows:
            verdict = "ok" if not r["unordered"] else f"UNORDERED {r['unordered'][:3]}"
            print(f"{r['target']} {r['shapes']} num_warps {r['num_warps']} {r['kernel']}: {r['stores']} stores, "
                  f"{r['barriers']} barriers: {verdict}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(not r["unordered"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
