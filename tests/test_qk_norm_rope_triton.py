"""The fused q/k norm + rotary + K/V store kernel and the sigmoid-gated attention epilogue vs the references.

Runs on CPU under the Triton interpreter at odd sizes; on a CUDA machine the same tests run compiled.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.forward_batch import ForwardBatch, KVCache  # noqa: E402
from armillary.kernels import ops  # noqa: E402
from armillary.kernels.attention import paged_attention, write_kv  # noqa: E402
from armillary.kernels.norm import rms_norm  # noqa: E402
from armillary.kernels.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq  # noqa: E402
from armillary.kernels.triton.paged_attention import paged_attention_decode, paged_attention_prefill  # noqa: E402
from armillary.kernels.triton.qk_norm_rope import qk_norm_rope_store  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-6, torch.float16: 2e-3}
FORCE_SPLITS = {"BLOCK_N": 16, "target_waves": 64, "split_min_tokens": 16}
SENTINEL = 7.0  # cache slots the step does not own keep it


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out.float()).all()
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(DEVICE, dtype)


def gated_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """The module's projection layout: rows [q0 | g0 | q1 | g1 | ... | k | v] -> (query, gate, k, v) views."""
    qkv = randn(t, 2 * hq * d + 2 * hkv * d, seed=t + d, dtype=dtype, scale=3.0)
    query_gate, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
    query, gate = query_gate.view(t, hq, 2 * d).split(d, dim=-1)
    return query, gate, k.view(t, hkv, d), v.view(t, hkv, d)


def caches(hkv: int, d: int, dtype: torch.dtype, num_blocks: int = 6, page: int = 4) -> KVCache:
    fill = dict(dtype=dtype, device=DEVICE)
    return KVCache(torch.full((num_blocks, page, hkv, d), SENTINEL, **fill),
                   torch.full((num_blocks, page, hkv, d), SENTINEL, **fill))


def slots_for(t: int, num_slots: int, seed: int) -> torch.Tensor:
    """Distinct scattered slots, the second token a padding token (-1, no store)."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:t]
    if t > 1:
        slots[1] = -1
    return slots.to(DEVICE)


def reference(query, k, v, qw, kw, eps, cos, sin, cache, slots, zero_centered=True, interleaved=False):
    """Today's unfused sequence: norm, rotary, then the K/V write (padding tokens dropped)."""
    q = apply_rotary(rms_norm(query, qw, eps, zero_centered), cos, sin, interleaved)
    k = apply_rotary(rms_norm(k, kw, eps, zero_centered), cos, sin, interleaved)
    keep = slots >= 0
    write_kv(cache, k[keep], v[keep], slots[keep])
    return q


CASES = [
    # tokens, hq, hkv, head_dim, rotary_dim, dtype, cache dtype
    (5, 3, 1, 60, 20, torch.float32, torch.float32),
    (5, 4, 2, 64, 16, torch.float16, torch.float16),
    (5, 4, 2, 60, 60, torch.float16, torch.float16),
    (70, 3, 1, 64, 32, torch.float32, torch.float32),  # > 64 tokens: several heads a program
    (70, 4, 2, 60, 20, torch.float16, torch.float16),
    (5, 4, 2, 64, 16, torch.float32, torch.float16),  # k rounded to the input dtype, then the cache's
]


@pytest.mark.parametrize("t,hq,hkv,d,rot,dtype,cache_dtype", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_matches_unfused_reference(t, hq, hkv, d, rot, dtype, cache_dtype, interleaved):
    query, _, k, v = gated_qkv(t, hq, hkv, d, dtype)
    qw, kw = randn(d, seed=1, dtype=dtype, scale=0.2), randn(d, seed=2, dtype=dtype, scale=0.2)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cos, sin = rotary_cos_sin(positions, rotary_inv_freq(rot, 1e6, DEVICE))
    num_blocks, page = 2 * t // 4 + 2, 4
    cache, ref_cache = caches(hkv, d, cache_dtype, num_blocks, page), caches(hkv, d, cache_dtype, num_blocks, page)
    slots = slots_for(t, num_blocks * page, seed=t)
    before = (query.clone(), k.clone(), v.clone())

    q = qk_norm_rope_store(query, k, v, qw, kw, 1e-6, cos, sin, cache.k, cache.v, slots, True, interleaved)
    ref_q = reference(query, k, v, qw, kw, 1e-6, cos, sin, ref_cache, slots, True, interleaved)
    assert q.shape == (t, hq, d) and q.dtype == dtype and q.is_contiguous()
    assert rel_err(q, ref_q) < TOL[dtype]
    if rot < d:  # past rotary_dim: only the norm
        assert rel_err(q[..., rot:], ref_q[..., rot:]) < TOL[dtype]
    written = slots[slots >= 0]
    flat = lambda c: c.view(-1, hkv, d)  # noqa: E731
    assert rel_err(flat(cache.k)[written], flat(ref_cache.k)[written]) < TOL[dtype]
    assert torch.equal(flat(cache.v)[written], flat(ref_cache.v)[written])  # v stored as is
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert (flat(cache.k)[untouched] == SENTINEL).all() and (flat(cache.v)[untouched] == SENTINEL).all()
    assert all(torch.equal(a, b) for a, b in zip(before, (query, k, v)))  # the projection is read only


def test_plain_norm_and_contiguous_inputs():
    """Not zero-centred (x̂ · w), no gate interleave: q, k, v as contiguous tensors of their own."""
    t, hq, hkv, d, rot = 3, 2, 1, 32, 32
    query, k, v = randn(t, hq, d, seed=4), randn(t, hkv, d, seed=5), randn(t, hkv, d, seed=6)
    qw, kw = randn(d, seed=7), randn(d, seed=8)
    cos, sin = rotary_cos_sin(torch.tensor([0, 9, 300], device=DEVICE), rotary_inv_freq(rot, 1e4, DEVICE))
    cache, ref_cache = caches(hkv, d, torch.float32), caches(hkv, d, torch.float32)
    slots = torch.tensor([3, 0, 17], device=DEVICE)
    q = qk_norm_rope_store(query, k, v, qw, kw, 1e-5, cos, sin, cache.k, cache.v, slots, zero_centered=False)
    ref_q = reference(query, k, v, qw, kw, 1e-5, cos, sin, ref_cache, slots, zero_centered=False)
    assert rel_err(q, ref_q) < 1e-6 and rel_err(cache.k, ref_cache.k) < 1e-6 and torch.equal(cache.v, ref_cache.v)


def test_rejects_rotary_dim_past_head_dim():
    query, _, k, v = gated_qkv(2, 2, 1, 16, torch.float32)
    cos, sin = rotary_cos_sin(torch.arange(2, device=DEVICE), rotary_inv_freq(32, 1e4, DEVICE))
    cache = caches(1, 16, torch.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope_store(query, k, v, torch.zeros(16), torch.zeros(16), 1e-6, cos, sin, cache.k, cache.v,
                           torch.arange(2, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_triton_and_reference_backends_agree(dtype):
    """ops.qk_norm_rope_store and ops.attention(gate=...): the module's two calls, on both backends."""
    t, hq, hkv, d, rot = 5, 4, 2, 64, 16
    query, gate, k, v = gated_qkv(t, hq, hkv, d, dtype)
    qw, kw = randn(d, seed=1, dtype=dtype, scale=0.2), randn(d, seed=2, dtype=dtype, scale=0.2)
    cos, sin = rotary_cos_sin(torch.arange(3, 3 + t, device=DEVICE), rotary_inv_freq(rot, 1e6, DEVICE))
    # one sequence of 3 cached + 5 new tokens in blocks [2, 0] of 4 slots
    i32 = dict(dtype=torch.int32, device=DEVICE)
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long, device=DEVICE), positions=torch.arange(3, 3 + t, device=DEVICE),
        query_start_loc=torch.tensor([0, t], **i32), context_lens=torch.tensor([3], **i32),
        seq_lens=torch.tensor([3 + t], **i32), slot_mapping=torch.tensor([11, 0, 1, 2, 3], device=DEVICE),
        block_tables=torch.tensor([[2, 0]], **i32), state_slots=torch.zeros(1, dtype=torch.long, device=DEVICE),
        logits_indices=torch.tensor([t - 1], device=DEVICE), caches=[],
        query_start_loc_cpu=[0, t], context_lens_cpu=[3], seq_lens_cpu=[3 + t], max_seq_len=3 + t,
    )  # fmt: skip
    results = {}
    try:
        for backend in ("reference", "triton"):
            ops.set_backend(backend)
            cache = caches(hkv, d, dtype, num_blocks=3)
            cache.k[2, :3] = randn(3, hkv, d, seed=9, dtype=dtype)  # the 3 cached tokens
            cache.v[2, :3] = randn(3, hkv, d, seed=10, dtype=dtype)
            q = ops.qk_norm_rope_store(query, k, v, qw, kw, 1e-6, cos, sin, cache, batch)
            out = ops.attention(q, cache, batch, d**-0.5, gate=gate)
            results[backend] = (q, cache.k.clone(), cache.v.clone(), out)
    finally:
        ops.set_backend("auto")
    for got, ref in zip(results["triton"], results["reference"]):
        assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 4e-3)


def paged_setup(seq_lens: list[int], hkv: int, d: int, dtype: torch.dtype, page: int = 16):
    g = torch.Generator().manual_seed(sum(seq_lens))
    max_blocks = max(-(-n // page) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(DEVICE, dtype)
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks).to(DEVICE, torch.int32)
    return k_cache, v_cache, tables


def gate_after(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The unfused epilogue the model ran before: two torch ops on the flattened heads."""
    t = out.shape[0]
    return (out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))).view(out.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [{"BLOCK_N": 16}, FORCE_SPLITS])
def test_decode_gate_epilogue(dtype, config):
    """Gate fused into the store (one split) or the split combine: equals gating the ungated output."""
    seq_lens, hq, hkv, d = [1, 9, 40], 6, 2, 60
    k_cache, v_cache, tables = paged_setup(seq_lens, hkv, d, dtype)
    _, gate, _, _ = gated_qkv(len(seq_lens), hq, hkv, d, dtype)
    q = randn(len(seq_lens), hq, d, seed=11, dtype=dtype, scale=3.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    plain = paged_attention_decode(q, k_cache, v_cache, tables, lens, d**-0.5, config=config)
    gated = paged_attention_decode(q, k_cache, v_cache, tables, lens, d**-0.5, config=config, gate=gate)
    assert gated.dtype == dtype and rel_err(gated, gate_after(plain, gate)) < TOL[dtype]
    ref = paged_attention(q, KVCache(k_cache, v_cache), tables, list(range(len(seq_lens) + 1)), seq_lens, d**-0.5)
    assert rel_err(gated, gate_after(ref, gate)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("config", [None, FORCE_SPLITS])
def test_prefill_gate_epilogue(config):
    query_lens, seq_lens, hq, hkv, d = [5, 1, 3], [5, 20, 35], 4, 2, 64
    k_cache, v_cache, tables = paged_setup(seq_lens, hkv, d, torch.float16)
    t = sum(query_lens)
    _, gate, _, _ = gated_qkv(t, hq, hkv, d, torch.float16)
    q = randn(t, hq, d, seed=12, dtype=torch.float16, scale=3.0)
    qsl = [0, 5, 6, 9]
    args = (q, k_cache, v_cache, tables, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), max(query_lens), 0.125)
    plain = paged_attention_prefill(*args, config=config)
    gated = paged_attention_prefill(*args, config=config, gate=gate)
    assert rel_err(gated, gate_after(plain, gate)) < 2e-3


def test_gate_shape_is_checked():
    k_cache, v_cache, tables = paged_setup([4], 1, 16, torch.float32)
    q = randn(1, 2, 16)
    with pytest.raises(ValueError, match="gate"):
        paged_attention_decode(q, k_cache, v_cache, tables, torch.tensor([4], dtype=torch.int32, device=DEVICE),
                               0.25, gate=randn(1, 2, 8))
