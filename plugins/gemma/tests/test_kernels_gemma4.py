"""Gemma 4's fused decode kernels (norm chains, router tail, q/k/v norm + rope + store, logit soft-cap, fused GEMVs)
against fp32 references at odd sizes (on the CPU through Triton's interpreter), and against the unfused core ops."""
from __future__ import annotations

import pytest
import torch

from armillary_gemma.ops import naive
from armillary_gemma.ops.layer_norms import attn_out_norms_triton, layer_tail_triton
from armillary_gemma.ops.qkv_rope import qkv_norm_rope_store_triton
from armillary_gemma.ops.router import gemma4_route_triton
from armillary_gemma.ops.softcap import softcap_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
# float16 for the rounded intermediates: the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest);
# bench/gemma_gpu_checks.py checks bfloat16 at the real sizes on the GPU
ROUNDED = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _tol(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 3e-3


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("moe", [True, False])
@pytest.mark.parametrize("rows,dim", [(1, 2816), (5, 100), (3, 33)])
def test_attn_out_norms_match_the_reference(rows, dim, moe, dtype):
    gen = torch.Generator().manual_seed(rows * dim + moe)
    a, r = _rand(gen, rows, dim, scale=3, dtype=dtype), _rand(gen, rows, dim, dtype=dtype)
    w_post, w_pre, w_pre2, scale = (_rand(gen, dim, scale=0.3, shift=1.0, dtype=dtype) for _ in range(4))
    args = (a, r, w_post, w_pre, w_pre2 if moe else None, scale if moe else None, dim**-0.5, 1e-6)
    got, want = attn_out_norms_triton(*args), naive.attn_out_norms_ref(*args)
    assert [g is None for g in got] == [w is None for w in want] == [False, not moe, not moe, False]
    for g, w in zip(got, want):
        if w is not None:
            assert g.shape == w.shape and g.dtype == dtype and _rel(g, w) < _tol(dtype)


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("rows,dim,experts", [(1, 2816, 128), (3, 100, 13), (8, 33, 8), (2, 64, 1)])
def test_attn_out_norms_with_the_router_projection(rows, dim, experts, dtype):
    """At decode sizes the router logits come out of the norms launch (experts split over programs)."""
    gen = torch.Generator().manual_seed(rows * dim + experts)
    a, r = _rand(gen, rows, dim, scale=3, dtype=dtype), _rand(gen, rows, dim, dtype=dtype)
    w_post, w_pre, w_pre2, scale = (_rand(gen, dim, scale=0.3, shift=1.0, dtype=dtype) for _ in range(4))
    router_w = _rand(gen, experts, dim, scale=1.0, dtype=dtype)
    args = (a, r, w_post, w_pre, w_pre2, scale, dim**-0.5, 1e-6, router_w)
    got, want = attn_out_norms_triton(*args), naive.attn_out_norms_ref(*args)
    assert got[2].shape == (rows, experts) and got[2].dtype == dtype
    for g, w in zip(got, want):
        assert _rel(g, w) < _tol(dtype)


def test_attn_out_norms_keeps_the_router_gemm_for_prefill():
    """Past the decode sizes the wrapper returns the same logits through the router GEMM."""
    from armillary.kernels import ops
    from armillary_gemma.ops.layer_norms import ROUTER_MAX_ROWS, attn_out_norms

    gen = torch.Generator().manual_seed(11)
    rows, dim, experts = ROUTER_MAX_ROWS + 3, 40, 6
    a, r = _rand(gen, rows, dim, scale=3), _rand(gen, rows, dim)
    ws = [_rand(gen, dim, scale=0.3, shift=1.0) for _ in range(4)]
    router_w = _rand(gen, experts, dim)
    ops.set_backend("triton")
    try:
        got = attn_out_norms(a, r, *ws, dim**-0.5, 1e-6, router_w)
    finally:
        ops.set_backend("auto")
    want = naive.attn_out_norms_ref(a, r, *ws, dim**-0.5, 1e-6, router_w)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("moe,scalar,nxt", [(True, True, True), (False, True, True), (True, False, False),
                                            (False, True, False)])
@pytest.mark.parametrize("rows,dim", [(1, 2816), (7, 45)])
def test_layer_tail_matches_the_reference(rows, dim, moe, scalar, nxt, dtype):
    gen = torch.Generator().manual_seed(rows + dim)
    m, e, r = (_rand(gen, rows, dim, scale=s, dtype=dtype) for s in (2.0, 5.0, 1.0))
    w1, w2, w_ff, w_next = (_rand(gen, dim, scale=0.3, shift=1.0, dtype=dtype) for _ in range(4))
    s = torch.tensor([0.7], dtype=dtype, device=DEVICE)
    args = (m, e if moe else None, r, w1 if moe else None, w2 if moe else None, w_ff, s if scalar else None,
            w_next if nxt else None, 1e-6)
    (x, n), (want_x, want_n) = layer_tail_triton(*args), naive.layer_tail_ref(*args)
    assert x.dtype == dtype and _rel(x, want_x) < _tol(dtype)
    assert (n is None) == (not nxt)
    if nxt:
        assert _rel(n, want_n) < _tol(dtype)


def test_layer_tail_equals_the_unfused_core_ops_in_float32():
    """The fused tail is what the CPU path (core's norms and torch ops) computes."""
    from armillary_gemma.ops.layer_norms import layer_tail

    gen = torch.Generator().manual_seed(3)
    m, e, r = (_rand(gen, 3, 64) for _ in range(3))
    ws = [_rand(gen, 64, scale=0.2, shift=1.0) for _ in range(4)]
    s = torch.tensor([1.3], device=DEVICE)
    fused = layer_tail_triton(m, e, r, ws[0], ws[1], ws[2], s, ws[3], 1e-6)
    from armillary.kernels import ops

    ops.set_backend("reference")
    try:
        unfused = layer_tail(m, e, r, ws[0], ws[1], ws[2], s, ws[3], 1e-6)
    finally:
        ops.set_backend("auto")
    for f, u in zip(fused, unfused):
        torch.testing.assert_close(f, u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (5, 37, 3), (2, 6, 6)])
def test_route_matches_transformers_router_tail(tokens, experts, k, logit_dtype):
    gen = torch.Generator().manual_seed(tokens * experts + k)
    # distinct logits, exact in bf16: a tie would leave the pick to each top-k's tie-break (torch's differs by device)
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    logits = ((ranks - experts / 2) / 16).to(DEVICE, logit_dtype)
    per_expert = _rand(gen, experts, scale=0.2, shift=1.0, dtype=torch.bfloat16)
    weights, ids = gemma4_route_triton(logits, per_expert, k)
    want_w, want_ids = naive.gemma4_route_ref(logits, per_expert, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and weights.shape == (tokens, k)
    assert torch.equal(ids.long(), want_ids)
    assert _rel(weights, want_w) < 1e-6


def _cache(blocks: int, page: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(blocks, page, heads, dim, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize("tokens,hq,hkv,d,rot", [(1, 4, 2, 32, 16), (3, 3, 1, 24, 3), (5, 2, 2, 40, 20)])
def test_qkv_norm_rope_store_matches_the_reference(tokens, hq, hkv, d, rot, k_eq_v, dtype):
    gen = torch.Generator().manual_seed(tokens * d + k_eq_v)
    cols = (hq + hkv * (1 if k_eq_v else 2)) * d
    proj = _rand(gen, tokens, cols, scale=2, dtype=dtype)  # the fused projection's output: views, no copies
    q = proj[:, :hq * d].view(tokens, hq, d)
    k = proj[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = k if k_eq_v else proj[:, (hq + hkv) * d:].view(tokens, hkv, d)
    qw, kw = _rand(gen, d, scale=0.3, shift=1.0, dtype=dtype), _rand(gen, d, scale=0.3, shift=1.0, dtype=dtype)
    angles = torch.rand(tokens, rot, generator=gen) * 6.0
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    page = 4
    k_cache, v_cache = _cache(4, page, hkv, d, dtype), _cache(4, page, hkv, d, dtype)
    slots = torch.tensor([5, 14, -1, 2, 9][:tokens], device=DEVICE)  # one padding row (-1): no store
    want_q, want_k, want_v = naive.gemma4_qkv_norm_rope_ref(q, k, v, qw, kw, 1e-6, cos, sin)
    got_q = qkv_norm_rope_store_triton(q, k, v, qw, kw, 1e-6, cos, sin, k_cache, v_cache, slots)
    assert got_q.shape == (tokens, hq, d) and got_q.is_contiguous() and _rel(got_q, want_q) < _tol(dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, page)
        assert _rel(k_cache[blk, off], want_k[t]) < _tol(dtype)
        assert _rel(v_cache[blk, off], want_v[t]) < _tol(dtype)
    written = {divmod(s, page) for s in slots.tolist() if s >= 0}
    untouched = [(b, o) for b in range(4) for o in range(page) if (b, o) not in written]
    assert all(k_cache[b, o].abs().sum() == 0 and v_cache[b, o].abs().sum() == 0 for b, o in untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 262_144), (3, 1001)])
def test_softcap_matches_the_reference(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows + cols)
    logits = _rand(gen, rows, cols, scale=40, dtype=dtype)
    got = softcap_triton(logits, 30.0)
    want = naive.softcap_ref(logits, 30.0)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert _rel(got, want) < 1e-6 and got.abs().max() <= 30.0


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("kind", ["geglu", "softcap"])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 300), (3, 50, 64), (8, 16, 96), (5, 70, 33)])
def test_fused_gemv_matches_the_reference(rows, n, k, kind, dtype):
    from armillary_gemma.ops.gemv import gemma_gemv

    gen = torch.Generator().manual_seed(rows * n + k)
    x = _rand(gen, rows, 2 * k if kind == "geglu" else k, dtype=dtype)
    w = _rand(gen, n, k, scale=k**-0.5 * (8 if kind == "softcap" else 1), dtype=dtype)
    got, want = gemma_gemv(kind, x, w, 3.0), naive.gemma_gemv_ref(kind, x, w, 3.0)
    assert got.shape == (rows, n) and got.dtype == (dtype if kind == "geglu" else torch.float32)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_fused_gemv_is_opt_in_on_the_gpu_tables(monkeypatch):
    """On an sm_90 GPU the fused GEMVs wait for a measured ``"use": true``; the forced Triton backend takes them."""
    from armillary.kernels import ops, tuning
    from armillary_gemma.ops import gemv

    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: None)
    x, w = torch.empty(1, 2816, dtype=torch.bfloat16), torch.empty(262_144, 2816, dtype=torch.bfloat16)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # as on the GPU under "auto"
    with tuning.overlay("armillary_gemma"):
        expected = bool(gemv.config("softcap", 1, 262_144, 2816)["use"])
        assert gemv.serves("softcap", x, w) is expected
        assert not gemv.serves("softcap", torch.empty(9, 2816, dtype=torch.bfloat16), w)  # past max_rows
        assert not gemv.serves("geglu", x, w)  # x is not [gate | up] of the weight's width
        ops.set_backend("triton")
        try:
            assert gemv.serves("softcap", x, w)
        finally:
            ops.set_backend("auto")


@pytest.mark.parametrize("head_dim,splits_wanted", [(512, 64), (256, 64), (96, 8)])
def test_decode_attention_combines_many_splits_in_column_chunks(head_dim, splits_wanted):
    """Gemma 4's global decode (D 512, few kv heads, a CUDA graph's long max_seq_len) splits the keys many
    ways; the combine then takes the head dim in column chunks. Against the fp32 reference."""
    from armillary.forward_batch import KVCache
    from armillary.kernels.attention import paged_attention
    from armillary.kernels.triton.paged_attention import paged_attention_decode

    gen = torch.Generator().manual_seed(head_dim)
    page, hkv, hq, lens = 4, 1, 4, [37, 5]
    blocks = 1 + sum(-(-n // page) for n in lens)
    k_cache = _rand(gen, blocks, page, hkv, head_dim)
    v_cache = _rand(gen, blocks, page, hkv, head_dim)
    tables = torch.zeros(len(lens), -(-max(lens) // page), dtype=torch.int32, device=DEVICE)
    free = iter(range(1, blocks))
    for b, n in enumerate(lens):
        for i in range(-(-n // page)):
            tables[b, i] = next(free)
    q = _rand(gen, len(lens), hq, head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cfg = {"split_min_tokens": 1, "target_waves": splits_wanted, "BLOCK_N": 4}  # many splits of one tile
    got = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, max_seq_len=max(lens),
                                 config=cfg)
    want = paged_attention(q, KVCache(k_cache, v_cache), tables, list(range(len(lens) + 1)), lens, head_dim**-0.5)
    assert _rel(got, want) < 1e-5
