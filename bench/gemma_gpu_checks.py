"""GPU correctness checks of the kernels Gemma runs, at real sizes (prints one line per check; exit 1 on a failure).

- the plugin's GeGLU (``gelu_tanh_and_mul``) at Gemma-3-27B's FFN width, decode and prefill rows, with its
  time beside the unfused torch ops; its norm-add-norm at the 27B / 26B-A4B hidden sizes (Gemma 3's (1 + w)
  and Gemma 4's plain weights), beside core's two;
- the fused q/k norm + proportional rotary + K/V store at Gemma 4's global shape into a block-strided cache;
- core's Triton MoE with gelu-tanh experts at Gemma-4-26B-A4B's shape (128 experts, top 8, 704 wide), through
  the auto choice and each of the GEMV / decode / grouped paths that serves the token count;
- Gemma 4's fused decode kernels (``gemma4_fused``): the norms after attention, the layer tail, the router
  tail, the q/k/v norm + rope + store (sliding D 256 and global D 512 with k = v) and the logit soft-cap
  over the 262K vocabulary, each against its fp32 reference and timed beside the unfused ops it replaces;
- the fused GEMVs (``gemv``: GeGLU inside the down projection, soft-cap inside the tied head) at rows 1..8,
  timed beside the unfused pair, with the tuning-table entries that turn them on where they win;
- core's paged attention (decode and varlen prefill, windowed or not, soft-capped) over the byte-packed
  caches the planner gives Gemma-4-31B (sliding 16 × 256 pages, global 4 × 512 pages two per position),
  against the float32 reference.

    python bench/gemma_gpu_checks.py
    python bench/gemma_gpu_checks.py --smoke   # the driver itself on the CPU (interpreter), small sizes

Each check is isolated: an exception fails that check (its last line printed), the rest still run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "gemma"))

FAILED: list[str] = []
DEV = "cuda"
SMOKE = False  # --smoke: CPU, Triton's interpreter, small sizes
DOT_DTYPE = torch.bfloat16  # of the tl.dot kernels' inputs; float32 in --smoke: the interpreter's bf16 dot is wrong


def describe(e: BaseException) -> str:
    """One line for an exception: its type, its message's first and last lines (a Triton CompilationError's
    are the kernel position and the offending source line) and its cause's first line (the real reason)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "^"]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
    cause = e.__cause__ or e.__context__
    if cause is not None:
        first = str(cause).strip().splitlines()
        text += f" <- {type(cause).__name__}: {first[0] if first else ''}"
    return text[:800]


def check(name: str, compute, tol: float) -> None:
    """``compute()`` -> (got, want); a raised exception fails this check only."""
    try:
        got, want = compute()
        rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others' results
        FAILED.append(name)
        print(f"FAIL {name}: {describe(e)}", flush=True)
        return
    ok = rel < tol
    if not ok:
        FAILED.append(name)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {rel:.2e} (tol {tol:.0e})", flush=True)


def group(name: str, fn) -> None:
    """Runs one group of checks; an exception in its setup fails the group and the next group runs."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        FAILED.append(name)
        print(f"FAIL {name} (setup): {describe(e)}", flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, n: int = 50) -> float:
    """Microseconds per call (nan where the call raises: its check has said why)."""
    if SMOKE:
        return float("nan")
    try:
        for _ in range(3):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
    except Exception:  # noqa: BLE001
        return float("nan")
    return (time.perf_counter() - t) / n * 1e6


def geglu_checks() -> None:
    from armillary.kernels.activation import act_and_mul
    from armillary_gemma.ops.geglu import gelu_tanh_and_mul
    from armillary_gemma.ops.naive import gelu_tanh_and_mul_ref

    inter = 300 if SMOKE else 21504
    for rows in ((1, 3) if SMOKE else (1, 64, 4096)):
        x = torch.randn(rows, 2 * inter, device=DEV, dtype=torch.bfloat16) * 2
        check(f"geglu [{rows}, 2x{inter}] bf16", lambda: (gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x)), 1e-2)
        ours, torch_us = timed(lambda: gelu_tanh_and_mul(x)), timed(lambda: act_and_mul(x, "gelu_pytorch_tanh"))
        print(f"     geglu [{rows}, 2x{inter}]: triton {ours:.1f} us, torch ops {torch_us:.1f} us", flush=True)


def norm_checks() -> None:
    from armillary.kernels import ops
    from armillary_gemma.ops.naive import norm_add_norm_ref
    from armillary_gemma.ops.norm import norm_add_norm_triton

    for rows, dim, zc in (((1, 5376, True), (3, 2816, False)) if SMOKE else
                          ((1, 5376, True), (4096, 5376, True), (1, 2816, False), (4096, 2816, False))):
        h = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16) * 3
        r = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        w1 = (torch.rand(dim, device=DEV) - 0.5).to(torch.bfloat16)
        w2 = torch.rand(dim, device=DEV).to(torch.bfloat16)
        got, want = {}, {}

        def run(part: int):
            if not got:
                got["v"] = norm_add_norm_triton(h, r, w1, w2, 1e-6, zc)
                want["v"] = norm_add_norm_ref(h, r, w1, w2, 1e-6, zc)
            return got["v"][part], want["v"][part]

        label = f"norm_add_norm [{rows}, {dim}] bf16 zero_centered={zc}"
        check(f"{label} residual", lambda: run(1), 1e-2)
        check(f"{label} normed", lambda: run(0), 1e-2)
        fused = timed(lambda: norm_add_norm_triton(h, r, w1, w2, 1e-6, zc))
        core = timed(lambda: ops.add_rms_norm(ops.rms_norm(h, w1, 1e-6, zc), r, w2, 1e-6, zc))
        print(f"     norm_add_norm [{rows}, {dim}]: fused {fused:.1f} us, core's two launches {core:.1f} us",
              flush=True)


def moe_checks() -> None:
    from armillary.kernels.moe import fused_moe as reference
    from armillary.kernels.moe import softmax_topk
    from armillary.kernels.triton.moe import fused_moe

    experts, hidden, inter, k = (16, 96, 40, 4) if SMOKE else (128, 2816, 704, 8)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=DOT_DTYPE) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=DOT_DTYPE) * 0.02
    for tokens in ((1, 9) if SMOKE else (1, 8, 512)):
        x = torch.randn(tokens, hidden, device=DEV, dtype=DOT_DTYPE)
        weights, ids = softmax_topk(torch.randn(tokens, experts, device=DEV), k, True)
        want = reference(x.float(), w13.float(), w2.float(), weights, ids, "gelu_pytorch_tanh")
        for path in ("auto", "gemv", "decode", "grouped"):
            if path == "gemv" and tokens > 8 or path == "decode" and tokens * k > 64:
                continue  # outside what those paths serve
            check(f"moe gelu_tanh {str(DOT_DTYPE)[6:]} T={tokens} E={experts} k={k} I={inter} path={path}",
                  lambda: (fused_moe(x, w13, w2, weights, ids, "gelu_pytorch_tanh", path=path), want), 2e-2)


def attention_checks() -> None:
    from armillary.cache_spec import FullAttention, SlidingWindow
    from armillary.kernels.attention import paged_attention, write_kv
    from armillary.kernels.triton.paged_attention import paged_attention_decode, paged_attention_prefill
    from armillary.memory.planner import allocate_caches, plan_memory

    window = 64 if SMOKE else 1024
    layout = ([SlidingWindow(16, 256, window=window)] * 5 + [FullAttention(4, 512)]) * 2
    max_len = 512 if SMOKE else 4096
    plan = plan_memory(layout, budget_bytes=(256 << 20) if SMOKE else (8 << 30), block_size=16, num_slots=2,
                       dtype=DOT_DTYPE, max_model_len=max_len, max_num_seqs=3, max_chunk=2048)
    caches, _ = allocate_caches(layout, plan, DOT_DTYPE, torch.device(DEV))
    print(f"     attention caches: uniform pages {plan.uniform_pages}, global k block stride {caches[5].k.stride(0)} "
          f"vs {caches[5].k[0].numel()} elements per page", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    lens = [300, 150, 17] if SMOKE else [3000, 1500, 17]
    tables = torch.zeros(3, max_len // 16, dtype=torch.int32, device=DEV)
    free = iter(range(1, plan.num_blocks))
    for b, n in enumerate(lens):
        for i in range(-(-n // 16)):
            tables[b, i] = next(free)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for layer, (win, heads) in {0: (window, 16), 5: (None, 4)}.items():
        cache, d, hq = caches[layer], caches[layer].k.shape[3], 32
        for b, n in enumerate(lens):  # every position of every sequence, through the reference store
            pos = torch.arange(n, device=DEV)
            slots = tables[b, pos // 16].long() * 16 + pos % 16
            write_kv(cache, torch.randn(n, heads, d, device=DEV, generator=gen, dtype=DOT_DTYPE),
                     torch.randn(n, heads, d, device=DEV, generator=gen, dtype=DOT_DTYPE), slots)
        for softcap in (None, 50.0):
            q = torch.randn(3, hq, d, device=DEV, generator=gen, dtype=DOT_DTYPE)
            check(f"decode D={d} Hkv={heads} window={win} softcap={softcap}", lambda: (
                paged_attention_decode(q, cache.k, cache.v, tables, seq_lens, d**-0.5, win, softcap,
                                       max_seq_len=max(lens)),
                paged_attention(q.float(), _f32(cache), tables, list(range(4)), lens, d**-0.5, win, softcap)), 2e-2)
        # batch 1 as the CUDA graph runs it: max_seq_len is the model's, so the keys split many ways (D 512: up to 64
        # splits, whose combine takes the head dim in column chunks)
        q1 = torch.randn(1, hq, d, device=DEV, generator=gen, dtype=DOT_DTYPE)

        def graph_like():
            return paged_attention_decode(q1, cache.k, cache.v, tables[1:2], seq_lens[1:2], d**-0.5, win, None,
                                          max_seq_len=65536)  # a 64K-token model's graphs

        check(f"decode B=1 D={d} Hkv={heads} window={win} max_seq_len=65536", lambda: (
            graph_like(), paged_attention(q1.float(), _f32(cache), tables[1:2], [0, 1], lens[1:2], d**-0.5, win,
                                          None)), 2e-2)
        print(f"     decode B=1 D={d} Hkv={heads} window={win} over {lens[1]} keys: {timed(graph_like):.1f} us",
              flush=True)
        chunk = [16, 70, 17] if SMOKE else [64, 700, 17]  # the last tokens of each sequence as a prefill chunk
        qsl = [0]
        for c in chunk:
            qsl.append(qsl[-1] + c)
        qp = torch.randn(qsl[-1], hq, d, device=DEV, generator=gen, dtype=DOT_DTYPE)
        check(f"prefill D={d} Hkv={heads} window={win}", lambda: (
            paged_attention_prefill(qp, cache.k, cache.v, tables, torch.tensor(qsl, dtype=torch.int32, device=DEV),
                                    seq_lens, max(chunk), d**-0.5, win, None, max_seq_len=max(lens)),
            paged_attention(qp.float(), _f32(cache), tables, qsl, lens, d**-0.5, win, None)), 2e-2)


def qk_norm_rope_checks() -> None:
    """The fused q/k norm + rotary + K/V store at Gemma 4's global shape (D 512, proportional rope: the
    last 3/4 of the frequencies zero) into a block-strided cache, against the reference ops."""
    from armillary.cache_spec import FullAttention, SlidingWindow
    from armillary.forward_batch import KVCache
    from armillary.kernels import reference
    from armillary.kernels.rotary import rotary_cos_sin
    from armillary.kernels.triton.qk_norm_rope import qk_norm_rope_store
    from armillary.memory.planner import allocate_caches, plan_memory
    from armillary_gemma.config import RopeArgs
    from armillary_gemma.rope import gemma_inv_freq

    layout = [SlidingWindow(16, 256, window=1024), FullAttention(4, 512), FullAttention(4, 512)]
    plan = plan_memory(layout, budget_bytes=(64 << 20) if SMOKE else (1 << 30), block_size=16, num_slots=2,
                       dtype=torch.bfloat16, max_model_len=1024, max_num_seqs=2, max_chunk=512)
    caches, _ = allocate_caches(layout, plan, torch.bfloat16, torch.device(DEV))
    tokens = 37
    slots = torch.arange(16, 16 + tokens, device=DEV)  # blocks 1..3
    qkv = torch.randn(tokens, 32 * 512 + 2 * 4 * 512, device=DEV, dtype=torch.bfloat16)
    q, k, v = qkv.split([32 * 512, 4 * 512, 4 * 512], dim=-1)
    q, k, v = q.view(tokens, 32, 512), k.view(tokens, 4, 512), v.view(tokens, 4, 512)
    qw = (torch.rand(512, device=DEV) + 0.5).to(torch.bfloat16)
    kw = (torch.rand(512, device=DEV) + 0.5).to(torch.bfloat16)
    with torch.device(DEV):
        inv = gemma_inv_freq(RopeArgs("proportional", 1e6, 1.0, 0.25), 512)
    cos, sin = rotary_cos_sin(torch.arange(100, 100 + tokens, device=DEV), inv)

    class _Batch:  # what the reference store reads of a batch
        def slot_mapping_of(self, cache):
            return slots

    got_q = want_q = None

    def run_q():
        nonlocal got_q, want_q
        got_q = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, caches[1].k, caches[1].v, slots,
                                   zero_centered=False)
        want_q = reference.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin,
                                              KVCache(caches[2].k, caches[2].v, caches[2].group), _Batch(), False)
        return got_q, want_q

    check("qk_norm_rope_store q, D=512 proportional", run_q, 1e-2)
    check("qk_norm_rope_store k into a block-strided cache", lambda: (
        caches[1].k[1:4].reshape(-1, 4, 512)[:tokens], caches[2].k[1:4].reshape(-1, 4, 512)[:tokens]), 1e-2)
    check("qk_norm_rope_store v into a block-strided cache", lambda: (
        caches[1].v[1:4].reshape(-1, 4, 512)[:tokens], caches[2].v[1:4].reshape(-1, 4, 512)[:tokens]), 1e-6)


def gemma4_fused_checks() -> None:
    """Gemma 4's fused decode kernels at the 26B-A4B sizes (bf16), each beside the unfused ops it replaces:
    the norms after attention, the layer tail, the router tail, the q/k/v norm + rope + store (sliding D 256,
    global D 512 with k = v, block-strided caches) and the logit soft-cap over the 262K vocabulary."""
    from armillary.cache_spec import FullAttention, SlidingWindow
    from armillary.forward_batch import KVCache
    from armillary.kernels import ops, tuning
    from armillary.kernels.rotary import rotary_cos_sin
    from armillary.memory.planner import allocate_caches, plan_memory
    from armillary_gemma.config import RopeArgs
    from armillary_gemma.ops import naive
    from armillary_gemma.ops.layer_norms import (attn_out_norms_triton, attn_out_norms_unfused, layer_tail_triton,
                                                 layer_tail_unfused)
    from armillary_gemma.ops.qkv_rope import qkv_norm_rope_store_triton
    from armillary_gemma.ops.router import gemma4_route_triton
    from armillary_gemma.ops.softcap import softcap_triton
    from armillary_gemma.rope import gemma_inv_freq

    bf = torch.float16 if SMOKE else torch.bfloat16  # the interpreter truncates to bfloat16; the GPU rounds
    hidden = 96 if SMOKE else 2816
    experts, top_k, vocab = (16, 4, 3001) if SMOKE else (128, 8, 262_144)

    def vec(scale=0.3, shift=1.0):
        return (torch.randn(hidden, device=DEV) * scale + shift).to(bf)

    for rows in ((1, 3) if SMOKE else (1, 8, 4096)):
        a = torch.randn(rows, hidden, device=DEV, dtype=bf) * 3
        r = torch.randn(rows, hidden, device=DEV, dtype=bf)
        args = (a, r, vec(), vec(), vec(), vec(), hidden**-0.5, 1e-6)
        got, want = attn_out_norms_triton(*args), naive.attn_out_norms_ref(*args)
        for name, g, w in zip(("mlp_in", "expert_in", "router_in", "residual"), got, want):
            check(f"attn_out_norms [{rows}, {hidden}] {name}", lambda g=g, w=w: (g, w), 1e-2)
        print(f"     attn_out_norms [{rows}, {hidden}]: fused {timed(lambda: attn_out_norms_triton(*args)):.1f} us, "
              f"core's ops {timed(lambda: attn_out_norms_unfused(*args)):.1f} us", flush=True)
        if rows <= 8:  # decode: the router's projection inside the launch
            router_w = torch.randn(experts, hidden, device=DEV, dtype=bf) * 0.05
            rargs = (*args, router_w)
            got_logits = attn_out_norms_triton(*rargs)[2]
            check(f"attn_out_norms [{rows}, {hidden}] + router [{experts}, {hidden}] logits",
                  lambda: (got_logits, naive.attn_out_norms_ref(*rargs)[2]), 1e-2)
            with tuning.overlay("armillary_gemma"):  # the router GEMM as the model runs it without the fold
                pair = timed(lambda: ops.linear(attn_out_norms_triton(*args)[2], router_w))
            fused = timed(lambda: attn_out_norms_triton(*rargs))
            print(f"     attn_out_norms + router [{rows}, {hidden}]: fused {fused:.1f} us, norms then the router GEMM "
                  f"{pair:.1f} us", flush=True)
        m, e = torch.randn(rows, hidden, device=DEV, dtype=bf) * 2, torch.randn(rows, hidden, device=DEV, dtype=bf)
        scalar = torch.tensor([0.7], device=DEV, dtype=bf)
        targs = (m, e, r, vec(), vec(), vec(), scalar, vec(), 1e-6)
        (x, nxt), (want_x, want_n) = layer_tail_triton(*targs), naive.layer_tail_ref(*targs)
        check(f"layer_tail [{rows}, {hidden}] residual", lambda: (x, want_x), 1e-2)
        check(f"layer_tail [{rows}, {hidden}] next norm", lambda: (nxt, want_n), 1e-2)
        print(f"     layer_tail [{rows}, {hidden}]: fused {timed(lambda: layer_tail_triton(*targs)):.1f} us, "
              f"core's ops {timed(lambda: layer_tail_unfused(*targs)):.1f} us", flush=True)
        logits = torch.randn(rows, experts, device=DEV) * 2  # float32: no ties, whose order torch.topk leaves open
        per_expert = (torch.rand(experts, device=DEV) + 0.5).to(bf)
        weights, ids = gemma4_route_triton(logits, per_expert, top_k)
        want_w, want_ids = naive.gemma4_route_ref(logits, per_expert, top_k)
        label = f"gemma4_route T={rows} E={experts} k={top_k}"
        check(f"{label} weights", lambda: (weights, want_w), 1e-5)
        same = torch.equal(ids.long(), want_ids)
        if not same:
            FAILED.append(f"{label} ids")
        print(f"{'ok  ' if same else 'FAIL'} {label} ids equal torch.topk's", flush=True)

    layout = [SlidingWindow(8, 256, window=1024), FullAttention(2, 512), SlidingWindow(8, 256, window=1024),
              FullAttention(2, 512)]
    plan = plan_memory(layout, budget_bytes=(64 << 20) if SMOKE else (1 << 30), block_size=16, num_slots=2,
                       dtype=bf, max_model_len=1024, max_num_seqs=2, max_chunk=512)
    caches, _ = allocate_caches(layout, plan, bf, torch.device(DEV))
    for tokens in ((1, 5) if SMOKE else (1, 8, 300)):
        slots = torch.arange(16, 16 + tokens, device=DEV)
        for (hkv, d, rope, k_eq_v), mine, ref in (((8, 256, RopeArgs("default", 1e4), False), caches[0], caches[2]),
                                                  ((2, 512, RopeArgs("proportional", 1e6, 1.0, 0.25), True),
                                                   caches[1], caches[3])):
            proj = torch.randn(tokens, 16 * d + hkv * d * (1 if k_eq_v else 2), device=DEV, dtype=bf)
            q = proj[:, :16 * d].view(tokens, 16, d)
            k = proj[:, 16 * d:16 * d + hkv * d].view(tokens, hkv, d)
            v = k if k_eq_v else proj[:, 16 * d + hkv * d:].view(tokens, hkv, d)
            qw, kw = (torch.rand(d, device=DEV) + 0.5).to(bf), (torch.rand(d, device=DEV) + 0.5).to(bf)
            with torch.device(DEV):
                inv = gemma_inv_freq(rope, d)
            cos, sin = rotary_cos_sin(torch.arange(100, 100 + tokens, device=DEV), inv)
            label = f"qkv_norm_rope_store T={tokens} Hkv={hkv} D={d} k_eq_v={k_eq_v}"
            got_q = qkv_norm_rope_store_triton(q, k, v, qw, kw, 1e-6, cos, sin, mine.k, mine.v, slots)
            want_q, want_k, want_v = naive.gemma4_qkv_norm_rope_ref(q, k, v, qw, kw, 1e-6, cos, sin)
            blocks = -(-(16 + tokens) // 16)
            stored_k = mine.k[1:blocks].reshape(-1, hkv, d)[:tokens]
            stored_v = mine.v[1:blocks].reshape(-1, hkv, d)[:tokens]
            check(f"{label} q", lambda: (got_q, want_q), 1e-2)
            check(f"{label} k stored", lambda: (stored_k, want_k), 1e-2)
            check(f"{label} v stored", lambda: (stored_v, want_v), 1e-2)

            class _Batch:
                def slot_mapping_of(self, cache):
                    return slots

            def two_launches():  # what the layer ran before: core's v norm, then its q/k norm + rope + store
                vn = ops.rms_norm(v, torch.ones(d, device=DEV, dtype=bf), 1e-6)
                return ops.qk_norm_rope_store(q, k, vn, qw, kw, 1e-6, cos, sin, KVCache(ref.k, ref.v, ref.group),
                                              _Batch(), zero_centered=False)

            def fused():
                return qkv_norm_rope_store_triton(q, k, v, qw, kw, 1e-6, cos, sin, mine.k, mine.v, slots)

            print(f"     {label}: fused {timed(fused):.1f} us, core's two launches {timed(two_launches):.1f} us",
                  flush=True)

    for rows in ((1, 2) if SMOKE else (1, 8, 64)):
        logits = torch.randn(rows, vocab, device=DEV, dtype=bf) * 40
        check(f"softcap [{rows}, {vocab}] cap 30", lambda: (softcap_triton(logits, 30.0),
                                                           naive.softcap_ref(logits, 30.0)), 1e-5)
        print(f"     softcap [{rows}, {vocab}]: fused {timed(lambda: softcap_triton(logits, 30.0)):.1f} us, torch ops "
              f"{timed(lambda: torch.tanh(logits.float() / 30.0) * 30.0):.1f} us", flush=True)


def gemv_checks() -> None:
    """The fused GEMVs (``ops.gemv``, opt-in per shape) at the real sizes: the down projection with the GeGLU
    inside (Gemma-4-26B-A4B and Gemma-3-27B) and the soft-capped tied head, rows 1..8, against the fp32
    reference and timed beside what the model runs without them (``ops.linear`` under the plugin's tables:
    core's skinny GEMM or cuBLAS, then the GeGLU / soft-cap launch). Prints the table entry that turns each
    on where it is faster; the entries go under ``"gemma_gemv"`` in plugins/gemma/armillary_gemma/tuning/."""
    import json

    from armillary.kernels import ops, tuning
    from armillary_gemma.ops import naive
    from armillary_gemma.ops.geglu import gelu_tanh_and_mul
    from armillary_gemma.ops.gemv import gemma_gemv
    from armillary_gemma.ops.softcap import softcap_triton

    bf = torch.float16 if SMOKE else torch.bfloat16
    if SMOKE:
        shapes = [("geglu", 48, 40), ("softcap", 3001, 64)]
    else:  # read off both bench models (decode_shapes.py): Gemma 4's and Gemma 3's down projections, Gemma 4's head
        from decode_shapes import gemma_fused_gemv_shapes

        shapes = sorted({s for model in ("gemma4", "gemma3") for s in gemma_fused_gemv_shapes(model)})
    wins = {}
    for kind, n, k in shapes:
        w = torch.randn(n, k, device=DEV, dtype=bf) * (k**-0.5 * (8 if kind == "softcap" else 1))
        for rows in ((1, 3) if SMOKE else (1, 2, 4, 8)):
            x = torch.randn(rows, 2 * k if kind == "geglu" else k, device=DEV, dtype=bf)
            label = f"gemma_gemv {kind} [{rows}, {x.shape[1]}] x [{n}, {k}]"
            check(label, lambda: (gemma_gemv(kind, x, w, 30.0), naive.gemma_gemv_ref(kind, x, w, 30.0)), 1e-2)
            with tuning.overlay("armillary_gemma"):
                if kind == "geglu":
                    fused = timed(lambda: gemma_gemv(kind, x, w))
                    pair = timed(lambda: ops.linear(gelu_tanh_and_mul(x), w))
                else:
                    fused = timed(lambda: gemma_gemv(kind, x, w, 30.0))
                    pair = timed(lambda: softcap_triton(ops.linear(x, w), 30.0))
            bytes_moved = n * k * w.element_size()
            print(f"     {label}: fused {fused:.1f} us ({bytes_moved / fused / 1e3:.0f} GB/s), "
                  f"unfused pair {pair:.1f} us", flush=True)
            if fused < pair:
                wins[f"{kind}_n{n}_k{k}_m{rows}"] = {"use": True}
    print(f"     gemma_gemv entries that win here: {json.dumps(wins)}", flush=True)


def _f32(cache):
    from armillary.forward_batch import KVCache

    return KVCache(cache.k.float(), cache.v.float(), cache.group)


GROUPS = {"geglu": geglu_checks, "norm": norm_checks, "moe": moe_checks, "attention": attention_checks,
          "qk_norm_rope": qk_norm_rope_checks, "gemma4_fused": gemma4_fused_checks, "gemv": gemv_checks}


def main() -> None:
    global DEV, SMOKE, DOT_DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton's interpreter, small sizes: checks the driver")
    ap.add_argument("--only", default="", help=f"comma-separated groups of {sorted(GROUPS)}")
    args = ap.parse_args()
    if args.smoke:
        DEV, SMOKE, DOT_DTYPE = "cpu", True, torch.float32
        os.environ["TRITON_INTERPRET"] = "1"  # before armillary (and triton) are first imported by a group
    torch.manual_seed(0)
    for name in (args.only.split(",") if args.only else GROUPS):
        group(name, GROUPS[name])
    print("all checks passed" if not FAILED else f"FAILED ({len(FAILED)}): {FAILED}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
