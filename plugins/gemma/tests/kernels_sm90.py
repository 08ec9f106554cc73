"""Every Triton launch a Gemma 3 27B / Gemma 4 26B-A4B step makes, compiled offline for sm_90 (no GPU needed).

Run as a script (``test_kernels_compile`` does, in a subprocess without TRITON_INTERPRET): the
kernel wrappers a decoder step calls (the plugin's GeGLU, norm-add-norm, Gemma 4 norm chains, router
tail, q/k/v norm + rotary + KV store, logit soft-cap and fused GEMVs; core's norms, fused q/k norm +
rotary + KV store, paged attention with windows and soft-caps, skinny GEMMs, router and gelu-tanh MoE)
run at the real shapes under bench/smem_check.py's recorder; each distinct launch is compiled
through Triton's ttir / ttgir passes and shared-memory allocation for sm_90. The interpreter the
unit tests use accepts kernels the compiler rejects (a plain-float module global read in a kernel,
for one): this catches them. Prints one JSON list
``[{"kernel", "where", "shared", "limit", "error"}]``.

    python plugins/gemma/tests/kernels_sm90.py [--quick]
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import smem_check  # noqa: E402
from gemma_gpu_checks import describe  # noqa: E402

from armillary.cache_spec import FullAttention, SlidingWindow  # noqa: E402
from armillary.kernels import ops, tuning  # noqa: E402
from armillary.memory.planner import allocate_caches, plan_memory  # noqa: E402
from armillary_gemma.ops.geglu import gelu_tanh_and_mul  # noqa: E402
from armillary_gemma.ops.gemv import gemma_gemv  # noqa: E402
from armillary_gemma.ops.layer_norms import attn_out_norms, layer_tail  # noqa: E402
from armillary_gemma.ops.norm import norm_add_norm  # noqa: E402
from armillary_gemma.ops.qkv_rope import qkv_norm_rope_store  # noqa: E402
from armillary_gemma.ops.router import gemma4_route  # noqa: E402
from armillary_gemma.ops.softcap import softcap_logits  # noqa: E402


@dataclass(frozen=True, slots=True)
class Attn:
    """One attention layer type: heads, head dim, window, k = v (Gemma 4 global layers)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    k_eq_v: bool = False


@dataclass(frozen=True, slots=True)
class GemmaShapes:
    name: str
    hidden: int
    inter: int  # dense MLP width
    attn: tuple[Attn, ...]
    zero_centered: bool  # Gemma 3's (1 + w) norms
    softcap: float | None  # attention logit soft-cap
    gemma4: bool
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0


GEMMA3_27B = GemmaShapes("gemma3-27b", 5376, 21504, (Attn(32, 16, 128, 1024), Attn(32, 16, 128, None)), True,
                         None, False)
GEMMA4_26B = GemmaShapes("gemma4-26b-a4b", 2816, 2112, (Attn(16, 8, 256, 1024), Attn(16, 2, 512, None, True)),
                         False, None, True, 128, 8, 704)
MODELS = (GEMMA3_27B, GEMMA4_26B)
BLOCK, MAX_LEN = 16, 16384


def _batch(query_lens: list[int], context_lens: list[int]) -> SimpleNamespace:
    """The ForwardBatch fields the wrappers read (one block table for every cache group)."""
    batch = smem_check._batch(SimpleNamespace(max_model_len=MAX_LEN, block_size=BLOCK),
                              smem_check.Step(tuple(query_lens), tuple(context_lens)))
    batch.block_tables_of = lambda cache: batch.block_tables
    batch.slot_mapping_of = lambda cache: batch.slot_mapping
    return batch


def _caches() -> list:
    """A sliding D 256 and a global D 512 cache as the planner lays them out for Gemma 4 (byte-packed pages),
    and Gemma 3's D 128 pair: the strides the kernels are specialised on."""
    layout = [SlidingWindow(8, 256, window=1024), FullAttention(2, 512), SlidingWindow(16, 128, window=1024),
              FullAttention(16, 128)]
    plan = plan_memory(layout, budget_bytes=64 << 20, block_size=BLOCK, num_slots=2, dtype=torch.bfloat16,
                       max_model_len=2048, max_num_seqs=2, max_chunk=512)
    return allocate_caches(layout, plan, torch.bfloat16, torch.device("cpu"))[0]


def _attention(m: GemmaShapes, a: Attn, cache, batch, t: int) -> None:
    """GemmaAttention.forward's kernels: (Gemma 4) v norm on a head view, fused q/k norm + rope + store, attention."""
    d, bf = a.head_dim, torch.bfloat16
    kv_cols = a.kv_heads * d
    proj = torch.empty(t, a.heads * d + kv_cols * (1 if a.k_eq_v else 2), dtype=bf)
    pieces = proj.split([a.heads * d, kv_cols] if a.k_eq_v else [a.heads * d, kv_cols, kv_cols], dim=-1)
    q, k = pieces[0].view(t, a.heads, d), pieces[1].view(t, a.kv_heads, d)
    v = k if a.k_eq_v else pieces[2].view(t, a.kv_heads, d)
    w = torch.empty(d, dtype=bf)
    cos = sin = torch.empty(t, d // 2)  # proportional rope too: its unrotated part is zero frequencies
    if m.gemma4:  # the plugin's q / k / v norms + rope + store
        q = qkv_norm_rope_store(q, k, v, w, w, torch.ones(d, dtype=bf), 1e-6, cos, sin, cache, batch)
    else:
        q = ops.qk_norm_rope_store(q, k, v, w, w, 1e-6, cos, sin, cache, batch, zero_centered=True)
    ops.attention(q, cache, batch, d**-0.5, sliding_window=a.window, softcap=m.softcap)


def _moe(m: GemmaShapes, x: torch.Tensor) -> None:
    """Gemma4MoE's kernels: router norm, softmax top-k, gelu-tanh experts; at few tokens the GEMV and decode
    paths explicitly too."""
    from armillary.kernels.triton.moe import fused_moe

    weights, ids = gemma4_route(torch.empty(x.shape[0], m.experts, dtype=torch.bfloat16),
                                torch.empty(m.experts, dtype=torch.bfloat16), m.top_k)
    w13 = torch.empty(m.experts, 2 * m.moe_inter, m.hidden, dtype=torch.bfloat16)  # never touched
    w2 = torch.empty(m.experts, m.hidden, m.moe_inter, dtype=torch.bfloat16)
    ops.fused_moe(x, w13, w2, weights, ids, "gelu_pytorch_tanh")
    if x.shape[0] <= 8:
        fused_moe(x, w13, w2, weights, ids, "gelu_pytorch_tanh", path="gemv")
    if x.shape[0] * m.top_k <= 16:
        fused_moe(x, w13, w2, weights, ids, "gelu_pytorch_tanh", path="decode")


def _projections(m: GemmaShapes, t: int) -> None:
    """The dense projections (qkv / qk, o, gate_up, down, router, tied head) through ops.linear, where it takes
    the skinny GEMM kernel (decode-sized steps; larger ones are cuBLAS, not Triton)."""
    from armillary.kernels.triton.skinny_gemm import serves

    shapes = [(m.hidden, m.inter), (2 * m.inter, m.hidden), (262_208 if not m.gemma4 else 262_144, m.hidden)]
    for a in m.attn:
        shapes += [(a.heads * a.head_dim + a.kv_heads * a.head_dim * (1 if a.k_eq_v else 2), m.hidden),
                   (m.hidden, a.heads * a.head_dim)]
    if m.experts:
        shapes.append((m.experts, m.hidden))
    for n, k in shapes:
        x, w = torch.empty(t, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)  # never touched
        if serves(x, w, None, require_win=False) is not None:  # no CPU matmul of a prefill chunk
            ops.linear(x, w)


def run_step(m: GemmaShapes, caches: list, query_lens: list[int], context_lens: list[int]) -> None:
    """Every kernel wrapper one Gemma decoder layer of each type calls, with the model's argument layouts."""
    t, bf = sum(query_lens), torch.bfloat16
    batch = _batch(query_lens, context_lens)
    x, r = torch.empty(t, m.hidden, dtype=bf), torch.empty(t, m.hidden, dtype=bf)
    w = torch.empty(m.hidden, dtype=bf)
    ops.rms_norm(x, w, 1e-6, m.zero_centered)
    _projections(m, t)
    pair = caches[:2] if m.gemma4 else caches[2:]
    for a, cache in zip(m.attn, pair):
        _attention(m, a, cache, batch, t)
    gelu_tanh_and_mul(torch.empty(t, 2 * m.inter, dtype=bf))
    if t <= 8:  # the down projection's GEMV with the GeGLU inside (opt-in per table entry)
        gemma_gemv("geglu", torch.empty(t, 2 * m.inter, dtype=bf), torch.empty(m.hidden, m.inter, dtype=bf))
    if m.gemma4:  # the norms after attention (with and without experts) and the layer tails
        router_w = torch.empty(m.experts, m.hidden, dtype=bf)
        for moe in (True, False):
            attn_out_norms(x, r, w, w, w if moe else None, w if moe else None, m.hidden**-0.5, 1e-6)
            if moe and t <= 8:  # decode: the router's projection inside the launch
                attn_out_norms(x, r, w, w, w, w, m.hidden**-0.5, 1e-6, router_w)
            layer_tail(x, x if moe else None, r, w, w, w, torch.empty(1, dtype=bf), w, 1e-6)
        layer_tail(x, None, r, None, None, w, None, None, 1e-6)  # the per-layer-input models' first tail
        if t <= 64:  # the head's output of a decode step (and a prefill's sampled rows)
            softcap_logits(torch.empty(t, 262_144, dtype=bf), 30.0)
        if t <= 8:  # the soft-capped head GEMV (opt-in per table entry)
            gemma_gemv("softcap", x, torch.empty(262_144, m.hidden, dtype=bf), 30.0)
    else:
        norm_add_norm(x, r, w, w, 1e-6, m.zero_centered)
    if m.experts:
        _moe(m, x)


def steps(quick: bool) -> list[tuple[list[int], list[int]]]:
    """Decode at batch 1 and 64 (short and long context), prefill chunks, a mixed step."""
    if quick:
        return [([1], [100]), ([1] * 8, [100] * 8), ([300], [0])]
    return [([1], [100]), ([1] * 64, [1100] * 64), ([1], [MAX_LEN - 1]), ([300], [0]), ([4096], [8192]),
            ([16384], [0]), ([509, 1, 1], [0, 7, 7])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one decode and one prefill step per model")
    args = ap.parse_args()
    target = smem_check.TARGETS["sm_90"]
    caches = _caches()
    jobs: dict = {}
    with smem_check.recording(target) as (launches, where):
        tuning.use_packages(("armillary_gemma",))
        for m in MODELS:
            for q, c in steps(args.quick):
                where[0] = f"{m.name}: q={q[:3]} ctx={c[:3]}"
                run_step(m, caches, q, c)
    smem_check.compile_jobs(launches, target, "gemma", jobs)
    rows = []
    for job in jobs.values():
        row = {"kernel": job.kernel.fn.__name__, "where": job.uses["gemma"], "limit": target.smem_limit,
               "shared": None, "error": None}
        try:
            row["shared"] = smem_check.shared_bytes(job)
        except Exception as e:  # noqa: BLE001 - every failing kernel is reported, not only the first
            row["error"] = describe(e)
        rows.append(row)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
