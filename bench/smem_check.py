"""Shared memory of every Triton kernel the GPU fast path launches, compiled offline (no GPU needed).

A launch fails with ``OutOfResources: shared memory`` when a kernel's pipelined tiles need more
than an SM offers, and the traceback does not name the kernel. This script finds it on any
machine: each shape set calls the wrappers one decoder step calls (kernels/ops.py and the Gated
DeltaNet mixer's), over a sweep of step sizes, with ``JITFunction.run`` replaced by a recorder, so
nothing runs; the wrappers see the target's tuning tables and SM count and pick their launch
configs as on the GPU. Each distinct launch is then compiled for the target through Triton's
passes up to shared-memory allocation, which fixes what the driver will ask for (the
``metadata["shared"]`` of a full compile), and compared with the target's limit.

    python bench/smem_check.py                       # tiny-fp32 and real-bf16, on sm_90 and sm_121
    python bench/smem_check.py --shapes real-fp32 --targets sm_90 --kernels gemm,attention --json out.json

New kernels: call their wrappers from ``run_step`` (as the model does); new targets: add to TARGETS
(its tuning tables are then used); new models: add a shape set.

Exits 1 when a launch does not fit. TRITON_INTERPRET is dropped before Triton is imported (the
interpreter replaces kernels when they are defined). Written against Triton 3.9: it binds each
launch with JITFunction's own binder, as ``JITFunction.run`` does, to get the exact specialisation.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse
import json
import multiprocessing
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from armillary.cuda_graphs import graph_buckets  # noqa: E402
from armillary.forward_batch import KVCache  # noqa: E402
from armillary.kernels import ops, tuning  # noqa: E402
from armillary.kernels.triton import paged_attention  # noqa: E402
from armillary.kernels.triton.causal_conv1d import causal_conv1d_prefill  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_slots  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import fused_gdn_decode  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_verify import fused_gdn_verify  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.gates import gdn_gates  # noqa: E402


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the tuning-table name, "sm_90"
    capability: int
    sm_count: int
    smem_limit: int  # opt-in shared memory per block, bytes


TARGETS = {
    "sm_90": Target("sm_90", 90, 132, 232448),  # H100 / H200
    "sm_121": Target("sm_121", 121, 48, 101376),  # GB10
}


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the fast path's launches depend on: one model's dims and the engine's step limits."""

    name: str
    dtype: torch.dtype
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    experts: int  # 0: dense MLP (plain torch, no Triton kernel)
    top_k: int
    moe_inter: int
    max_tokens: int  # max_num_batched_tokens
    max_seqs: int
    max_model_len: int
    conv_kernel: int = 4
    block_size: int = 16


def tiny_models(dtype: torch.dtype) -> list[ModelShapes]:
    """The tiny configs bench/gpu_checks.py runs (the plugin's transformers test cases)."""
    from plugins.qwen_gdn_moe.tests.hf_models import CASES

    models = []
    for case in CASES:
        t = case.text
        moe = case.is_moe
        models.append(ModelShapes(
            f"tiny {case.name}", dtype, t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], int(t["head_dim"] * t["rope_parameters"]["partial_rotary_factor"]),
            t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
            t["linear_value_head_dim"], t["num_experts"] if moe else 0, t["num_experts_per_tok"] if moe else 0,
            t["moe_intermediate_size"] if moe else 0, max_tokens=64, max_seqs=8, max_model_len=256,
        ))  # fmt: skip
    return models


QWEN36 = ModelShapes("Qwen3.6-35B-A3B", torch.bfloat16, 2048, 16, 2, 256, 64, 16, 32, 128, 128, 256, 8, 512,
                     max_tokens=8192, max_seqs=64, max_model_len=262144)
QWEN3_NEXT = replace(QWEN36, name="Qwen3-Next-80B-A3B", experts=512, top_k=10)
SHAPE_SETS: dict[str, Callable[[], list[ModelShapes]]] = {
    "tiny-fp32": lambda: tiny_models(torch.float32),
    "real-bf16": lambda: [QWEN36, QWEN3_NEXT],
    "real-fp32": lambda: [replace(QWEN36, dtype=torch.float32)],  # full size in fp32: no run uses it yet
}
DEFAULT_SHAPES = ("tiny-fp32", "real-bf16")


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: each sequence's new tokens and the tokens cached before them."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    def label(self) -> str:
        if all(q == 1 for q in self.query_lens):
            return f"decode B={len(self.query_lens)} ctx={self.context_lens[0]}"
        return f"prefill q={list(self.query_lens)} ctx={list(self.context_lens)}"


def step_sweep(m: ModelShapes) -> list[Step]:
    """Decode batches of every CUDA-graph bucket, prefill chunks of every power of two, a mixed step;
    each at an empty and at a full context (key splits)."""
    steps = []
    for b in graph_buckets(m.max_seqs):
        for ctx in (0, m.max_model_len - 1):
            steps.append(Step((1,) * b, (ctx,) * b))
    sizes = sorted({1 << i for i in range(1, m.max_tokens.bit_length()) if 1 << i <= m.max_tokens} | {m.max_tokens})
    for n in sizes:
        steps.append(Step((n,), (0,)))
        steps.append(Step((n,), (m.max_model_len - n,)))
    steps.append(Step((m.max_tokens - 3, 1, 1, 1), (0, 7, 7, 7)))
    return steps


def _batch(m: ModelShapes, step: Step) -> SimpleNamespace:
    """The ForwardBatch fields the kernel wrappers read."""
    seq_lens = [c + q for c, q in zip(step.context_lens, step.query_lens)]
    starts = [0]
    for q in step.query_lens:
        starts.append(starts[-1] + q)
    i32 = dict(dtype=torch.int32)
    batch = SimpleNamespace(
        query_start_loc=torch.tensor(starts, **i32), query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, **i32), seq_lens_cpu=seq_lens,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.zeros(len(seq_lens), -(-m.max_model_len // m.block_size), **i32),
        state_slots=torch.arange(len(seq_lens), dtype=torch.int64),
        is_decode_only=all(q == 1 for q in step.query_lens), max_seq_len=max(seq_lens),
        max_query_len=max(step.query_lens),
    )  # fmt: skip
    batch.block_tables_of = lambda cache: batch.block_tables  # one cache group
    batch.slot_mapping_of = lambda cache: batch.slot_mapping
    return batch


def _attention(m: ModelShapes, batch: SimpleNamespace, x: torch.Tensor) -> None:
    """GatedAttention.forward's kernels: fused q/k norms + rotary + KV store, gated paged attention;
    then the unfused q/k ops (rms_norm on head views, rotary, KV store) that ops still offers."""
    t, dt, d = x.shape[0], m.dtype, m.head_dim
    qkv = torch.empty(t, 2 * m.heads * d + 2 * m.kv_heads * d, dtype=dt)  # rows [q0 | g0 | ... | k | v]
    query_gate, k, v = qkv.split([2 * m.heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
    query, gate = query_gate.view(t, m.heads, 2 * d).split(d, dim=-1)
    k, v = k.view(t, m.kv_heads, d), v.view(t, m.kv_heads, d)
    norm_w = torch.empty(d, dtype=dt)
    cos = sin = torch.empty(t, m.rotary_dim // 2)
    cache = KVCache(torch.empty(4, m.block_size, m.kv_heads, d, dtype=dt),
                    torch.empty(4, m.block_size, m.kv_heads, d, dtype=dt))
    q = ops.qk_norm_rope_store(query, k, v, norm_w, norm_w, 1e-6, cos, sin, cache, batch)
    ops.attention(q, cache, batch, d**-0.5, gate=gate)
    q = ops.apply_rotary(ops.rms_norm(query, norm_w, 1e-6, True), cos, sin)
    k = ops.apply_rotary(ops.rms_norm(k, norm_w, 1e-6, True), cos, sin)
    ops.store_kv(cache, k, v, batch)


def _gated_deltanet(m: ModelShapes, batch: SimpleNamespace, t: int) -> None:
    """GatedDeltaNet.forward's kernels: fused decode step, or conv + chunked rule + gated norm."""
    dt, hk, hv, kd, vd = m.dtype, m.gdn_k_heads, m.gdn_v_heads, m.gdn_k_dim, m.gdn_v_dim
    key_dim, value_dim = hk * kd, hv * vd
    conv_dim = 2 * key_dim + value_dim
    seqs = batch.state_slots.shape[0]
    projected = torch.empty(t, conv_dim + value_dim + 2 * hv, dtype=dt)  # in_proj rows [q | k | v | z | b | a]
    conv_w = torch.empty(conv_dim, 1, m.conv_kernel, dtype=dt)[:, 0]
    conv_states = torch.empty(seqs, conv_dim, m.conv_kernel - 1, dtype=dt)
    ssm_states = torch.empty(seqs, hv, kd, vd)
    norm_w = torch.empty(vd, dtype=dt)
    if batch.is_decode_only:
        fused_gdn_decode(projected, conv_w, conv_states, ssm_states, torch.empty(hv), torch.empty(hv), norm_w,
                         1e-6, batch.state_slots, hk, kd, vd)
        drafts = 2  # a verify step of the same sequences (K = 2): three rows each
        fused_gdn_verify(projected.new_empty(t * (drafts + 1), projected.shape[1]), conv_w, conv_states, ssm_states,
                         torch.empty(hv), torch.empty(hv), norm_w, 1e-6, batch.state_slots,
                         torch.empty(t, drafts, dtype=torch.int32), hk, kd, vd)
        return
    mixed, z, b, a = projected.split([conv_dim, value_dim, hv, hv], dim=-1)
    gdn_gates(b, a, torch.empty(hv), torch.empty(hv))
    mixed = causal_conv1d_prefill(mixed, conv_w, None, conv_states, batch.state_slots, batch.query_start_loc,
                                  activation="silu", cu_seqlens_cpu=batch.query_start_loc_cpu)
    q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
    core = chunk_gated_delta_rule_slots(
        q.reshape(t, hk, kd), k.reshape(t, hk, kd), v.reshape(t, hv, vd), torch.empty(t, hv),
        torch.empty(t, hv, dtype=dt), batch.query_start_loc, ssm_states, batch.state_slots,
        cu_seqlens_cpu=batch.query_start_loc_cpu,
    )
    ops.gated_rms_norm(core, z.reshape(t, hv, vd), norm_w, 1e-6)


def _moe(m: ModelShapes, x: torch.Tensor) -> None:
    """SparseMoeBlock's kernels: softmax top-k router and the routed experts (the shared one is torch);
    at few tokens also the GEMV and decode paths explicitly, whether or not the table makes auto take them."""
    from armillary.kernels.triton.moe import fused_moe

    weights, ids = ops.softmax_topk(torch.empty(x.shape[0], m.experts, dtype=m.dtype), m.top_k, True)
    w13 = torch.empty(m.experts, 2 * m.moe_inter, m.hidden, dtype=m.dtype)  # never touched: no memory used
    w2 = torch.empty(m.experts, m.hidden, m.moe_inter, dtype=m.dtype)
    ops.fused_moe(x, w13, w2, weights, ids, "silu")
    if x.shape[0] <= 8:
        fused_moe(x, w13, w2, weights, ids, "silu", path="gemv")
    if x.shape[0] * m.top_k <= 16:
        fused_moe(x, w13, w2, weights, ids, "silu", path="decode")


def _projections(m: ModelShapes, t: int) -> None:
    """The dense projections (GDN in / out, attention qkv / o, router) through ops.linear, where it
    takes the skinny GEMM kernel (decode-sized steps: larger ones are cuBLAS, not Triton)."""
    from armillary.kernels.triton.skinny_gemm import serves

    d, gdn_v = m.head_dim, m.gdn_v_heads * m.gdn_v_dim
    shapes = [(2 * m.gdn_k_heads * m.gdn_k_dim + 2 * gdn_v + 2 * m.gdn_v_heads, m.hidden), (m.hidden, gdn_v),
              (2 * m.heads * d + 2 * m.kv_heads * d, m.hidden), (m.hidden, m.heads * d)]
    if m.experts:
        shapes.append((m.experts + 1, m.hidden))
    for n, k in shapes:
        x, w = torch.empty(t, k, dtype=m.dtype), torch.empty(n, k, dtype=m.dtype)
        if serves(x, w, None, require_win=False) is not None:  # no CPU matmul of a prefill chunk
            ops.linear(x, w)


def run_step(m: ModelShapes, step: Step) -> None:
    """Every kernel wrapper one decoder step of ``m`` calls, with the model's argument layouts."""
    batch = _batch(m, step)
    x = torch.empty(sum(step.query_lens), m.hidden, dtype=m.dtype)
    norm_w = torch.empty(m.hidden, dtype=m.dtype)
    ops.add_rms_norm(x, torch.empty_like(x), norm_w, 1e-6, True)
    ops.rms_norm(x, norm_w, 1e-6, True)
    _projections(m, x.shape[0])
    _attention(m, batch, x)
    _gated_deltanet(m, batch, x.shape[0])
    if m.experts:
        _moe(m, x)


@dataclass(slots=True)
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    where: str  # model and step of the launch


@contextmanager
def recording(target: Target) -> Iterator[tuple[list[Launch], list[str]]]:
    """Kernel launches are recorded, not run; wrappers see ``target``'s tuning tables and SM count.

    Yields (the launches, a one-item list holding the label stamped on the next launches)."""
    launches: list[Launch] = []
    where = [""]

    def record(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        launches.append(Launch(kernel, args, kwargs, where[0]))

    saved = (JITFunction.run, tuning.device_target, paged_attention._sm_count, ops.get_backend())
    JITFunction.run = record
    tuning.device_target = lambda device=None: target.name
    paged_attention._sm_count = lambda device: target.sm_count
    ops.set_backend("triton")
    tuning.use_packages(("armillary_qwen_gdn_moe",))  # the shape sets are Qwen models: their plugin's tables
    try:
        yield launches, where
    finally:
        JITFunction.run, tuning.device_target, paged_attention._sm_count = saved[:3]
        ops.set_backend(saved[3])


@dataclass(slots=True)
class CompileJob:
    """One distinct specialisation of a kernel for a target, as ``JITFunction.run`` would compile it."""

    kernel: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: Target
    uses: dict[str, str]  # shape set -> its first launch that needs this specialisation


def compile_jobs(launches: list[Launch], target: Target, shapes: str, jobs: dict[str, CompileJob]) -> None:
    """Bind each launch as the target's backend would and add the specialisations not seen yet."""
    backend = make_backend(GPUTarget("cuda", target.capability, 32))
    binders: dict[int, Callable] = {}
    for launch in launches:
        fn = launch.kernel
        if id(fn) not in binders:
            binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binders[id(fn)](*launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, opts)
        key = repr((fn.fn.__qualname__, fn.module, target.name, sorted(signature.items()), sorted(constexprs.items()),
                    sorted(attrs.items()), sorted(options.__dict__.items())))
        if key not in jobs:
            jobs[key] = CompileJob(fn, signature, constexprs, attrs, options.__dict__, target, {})
        jobs[key].uses.setdefault(shapes, launch.where)


def _allocated_shared(module, backend, options, capability: int) -> int:
    """The head of the backend's make_llir pipeline, up to shared-memory allocation (Triton 3.9's pass
    order): ``ttg.shared`` is final there, and the rest (LLVM lowering, O3) costs most of the time."""
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton._C.libtriton import nvidia, passes

    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm, False)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    ptx_version = get_ptx_version_from_options(options, backend.target.arch)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, ptx_version)
    pm.run(module, "smem_check")
    return int(module.get_int_attr("ttg.shared"))


def shared_bytes(job: CompileJob, exact: bool = False) -> int:
    """Compile ttir -> ttgir, then allocate shared memory (or, ``exact`` or on another Triton whose
    passes differ, run the whole llir stage, which records the same number in its metadata)."""
    target = GPUTarget("cuda", job.target.capability, 32)
    backend = make_backend(target)
    options = backend.parse_options(job.options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(job.kernel, job.signature, job.constexprs, job.attrs)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages: dict[str, Callable] = {}
    backend.add_stages(stages, options, src.language)
    metadata = {"target": target, **options.__dict__}
    module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
    if not exact:
        try:
            return _allocated_shared(module, backend, options, job.target.capability)
        except (AttributeError, TypeError, ImportError):  # pass names / signatures of another Triton version
            pass
    stages["llir"](module, metadata)
    return int(metadata["shared"])


_JOBS: list[CompileJob] = []  # read by forked workers


def _shared_of(index: int, exact: bool) -> int:
    return shared_bytes(_JOBS[index], exact)


def measure(jobs: list[CompileJob], workers: int, exact: bool = False) -> list[int]:
    """Shared bytes of each job, compiled in ``workers`` forked processes."""
    _JOBS[:] = jobs
    if workers <= 1 or len(jobs) <= 1:
        return [_shared_of(i, exact) for i in range(len(jobs))]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_shared_of, range(len(jobs)), [exact] * len(jobs)))


_SHOWN_CONSTEXPRS = ("BLOCK", "ROWS", "PAIRS", "BK", "BV", "BT", "HEAD_DIM", "K", "V", "GATED")


def record_jobs(shapes: str, target: Target, kernel_filter: list[str] | None, jobs: dict[str, CompileJob]) -> None:
    """Runs one shape set's step sweep under the recorder and adds its distinct launches to ``jobs``."""
    with recording(target) as (launches, where):
        for model in SHAPE_SETS[shapes]():
            for step in step_sweep(model):
                where[0] = f"{model.name} {str(model.dtype).removeprefix('torch.')}: {step.label()}"
                run_step(model, step)
    if kernel_filter:
        launches = [x for x in launches if any(f in x.kernel.fn.__name__ for f in kernel_filter)]
    compile_jobs(launches, target, shapes, jobs)


def check(shape_sets: list[str], targets: list[Target], kernel_filter: list[str] | None = None,
          workers: int = 2, exact: bool = False) -> list[dict]:
    """Records every shape set on every target, compiles the distinct launches; one row per launch config."""
    jobs: dict[str, CompileJob] = {}
    for target in targets:
        for shapes in shape_sets:
            # the launches' tensors (real-size expert weights, never touched) are freed before the workers fork
            record_jobs(shapes, target, kernel_filter, jobs)
    job_list = list(jobs.values())
    sizes = measure(job_list, workers, exact)
    rows = []
    for job, shared in zip(job_list, sizes):
        names = [job.kernel.arg_names[path[0]] for path in job.constexprs]
        consts = {n: v for n, v in zip(names, job.constexprs.values())
                  if any(n.startswith(p) for p in _SHOWN_CONSTEXPRS) and isinstance(v, (int, bool))}
        for shapes, where in job.uses.items():
            rows.append(dict(
                target=job.target.name, limit=job.target.smem_limit, shapes=shapes, kernel=job.kernel.fn.__name__,
                shared=shared, fits=shared <= job.target.smem_limit, num_warps=job.options["num_warps"],
                num_stages=job.options["num_stages"],
                dtypes=sorted({v for v in job.signature.values() if v.startswith("*")}), constexprs=consts, where=where,
            ))  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    """Per target, shape set and kernel: the largest shared memory over its launch configs; then the overflows."""
    worst: dict[tuple, dict] = {}
    for r in rows:
        key = (r["target"], r["shapes"], r["kernel"])
        if key not in worst or r["shared"] > worst[key]["shared"]:
            worst[key] = {**r, "configs": sum(1 for x in rows if (x["target"], x["shapes"], x["kernel"]) == key)}
    lines = [f"{'target':7} {'shapes':10} {'kernel':32} {'configs':>7} {'max shared':>10} {'limit':>7}  worst launch"]
    for (target, shapes, kernel), r in sorted(worst.items()):
        flag = "" if r["fits"] else "  OVER"
        lines.append(f"{target:7} {shapes:10} {kernel:32} {r['configs']:7d} {r['shared']:10d} {r['limit']:7d}{flag}  "
                     f"warps {r['num_warps']} stages {r['num_stages']} {r['constexprs']} [{r['where']}]")
    over = [r for r in rows if not r["fits"]]
    lines.append(f"{len(rows)} launch configs, {len(over)} over the limit")
    for r in over:
        lines.append(f"  OVER {r['target']} {r['kernel']}: {r['shared']} > {r['limit']}, warps {r['num_warps']} "
                     f"stages {r['num_stages']} {r['dtypes']} {r['constexprs']} [{r['where']}]")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list of {sorted(SHAPE_SETS)}")
    parser.add_argument("--targets", default="sm_90,sm_121", help=f"comma list of {sorted(TARGETS)}")
    parser.add_argument("--kernels", default="", help="comma list of substrings of kernel names (default: all)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--exact", action="store_true", help="run the whole llir stage (slower, same numbers)")
    parser.add_argument("--json", default="", help="write every launch config's row here ('-': stdout only)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice, once per process
    start = time.perf_counter()
    rows = check(args.shapes.split(","), [TARGETS[t] for t in args.targets.split(",")],
                 [k for k in args.kernels.split(",") if k] or None, args.workers, args.exact)
    if args.json == "-":
        print(json.dumps(rows))
    else:
        print(report(rows))
        print(f"({time.perf_counter() - start:.0f} s)")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
