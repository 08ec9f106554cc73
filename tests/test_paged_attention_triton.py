"""Triton paged attention (decode, varlen prefill) and the fused KV write against the torch reference.

Runs on CPU under the Triton interpreter (tiny, odd sizes); on a CUDA machine the same tests run the
compiled kernels.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.forward_batch import KVCache  # noqa: E402
from armillary.kernels.attention import paged_attention, write_kv  # noqa: E402
from armillary.kernels.triton.kv_cache import write_kv_cache  # noqa: E402
from armillary.kernels.triton.paged_attention import paged_attention_decode, paged_attention_prefill  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
# Many splits even at tiny lengths, to exercise the split-KV combine.
FORCE_SPLITS = {"target_waves": 64, "split_min_tokens": 16}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _paged_setup(seq_lens: list[int], hkv: int, d: int, page: int, dtype: torch.dtype, seed: int):
    """Random caches with shuffled, non-contiguous blocks per sequence: (k_cache, v_cache, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // page) for n in seq_lens) + 1  # one spare column of padding
    num_blocks = len(seq_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


DECODE_CASES = [
    # hq, hkv, d, page, dtype, config
    (4, 4, 64, 16, torch.float32, {"BLOCK_N": 16}),
    (6, 3, 40, 32, torch.float16, {"BLOCK_N": 16}),
    (8, 2, 64, 16, torch.float16, {"BLOCK_N": 32}),
    (16, 2, 32, 64, torch.float32, {"BLOCK_N": 16}),
    (8, 1, 64, 16, torch.float32, {"BLOCK_N": 16, **FORCE_SPLITS}),
    (8, 4, 64, 32, torch.float16, {"BLOCK_N": 64, **FORCE_SPLITS}),
]


@pytest.mark.parametrize("hq,hkv,d,page,dtype,config", DECODE_CASES)
def test_decode_matches_reference(hq, hkv, d, page, dtype, config):
    seq_lens = [1, 7, 33, 50]
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, hkv, d, page, dtype, seed=hq * 100 + d)
    q = (3 * torch.randn(len(seq_lens), hq, d, generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = paged_attention_decode(q, k_cache, v_cache, block_tables, _i32(seq_lens), scale, config=config)
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, list(range(len(seq_lens) + 1)), seq_lens, scale)
    assert out.shape == (len(seq_lens), hq, d) and out.dtype == dtype
    assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window,softcap,config", [
    (9, None, {"BLOCK_N": 16}),
    (None, 5.0, {"BLOCK_N": 16, **FORCE_SPLITS}),
    (20, 2.0, {"BLOCK_N": 16, **FORCE_SPLITS}),
    (64, None, {"BLOCK_N": 32}),
])
def test_decode_window_and_softcap(window, softcap, config):
    seq_lens = [1, 7, 33, 50, 70]
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, 2, 64, 16, torch.float32, seed=7)
    q = 3 * torch.randn(len(seq_lens), 8, 64, device=DEVICE)
    out = paged_attention_decode(q, k_cache, v_cache, block_tables, _i32(seq_lens), 0.125, window, softcap,
                                 config=config)
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, list(range(len(seq_lens) + 1)), seq_lens,
                          0.125, window, softcap)
    assert _rel_err(out, ref) < 1e-5


def test_decode_padding_rows_are_zero_and_every_row_is_written():
    seq_lens = [33, 0, 5, 0]
    k_cache, v_cache, block_tables = _paged_setup([33, 5, 5, 5], 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(4, 8, 64, device=DEVICE)
    for config in ({"BLOCK_N": 16}, {"BLOCK_N": 16, **FORCE_SPLITS}):
        out = torch.full((4, 8, 64), float("nan"), device=DEVICE)
        paged_attention_decode(q, k_cache, v_cache, block_tables, _i32(seq_lens), 0.125, out=out, config=config)
        ref = paged_attention(q[[0, 2]], KVCache(k_cache, v_cache), block_tables[[0, 2]], [0, 1, 2], [33, 5], 0.125)
        assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
        assert _rel_err(out[[0, 2]], ref) < 1e-5


PREFILL_CASES = [
    # hq, hkv, d, page, dtype, config
    (4, 4, 64, 16, torch.float32, {"BLOCK_M": 16, "BLOCK_N": 16}),
    (8, 4, 40, 32, torch.float16, {"BLOCK_M": 16, "BLOCK_N": 16}),
    (8, 2, 64, 16, torch.float32, {"BLOCK_M": 32, "BLOCK_N": 32}),
    (16, 2, 32, 16, torch.float16, {"BLOCK_M": 32, "BLOCK_N": 16}),
    (6, 2, 64, 64, torch.float32, {"BLOCK_M": 16, "BLOCK_N": 32}),
]


@pytest.mark.parametrize("hq,hkv,d,page,dtype,config", PREFILL_CASES)
def test_prefill_mixed_batch_matches_reference(hq, hkv, d, page, dtype, config):
    # whole prompts, a decode, and chunks after prior context (2 and 30 cached tokens)
    query_lens = [1, 5, 33, 20, 7]
    seq_lens = [1, 7, 33, 50, 7]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, hkv, d, page, dtype, seed=hq + d)
    q = (3 * torch.randn(qsl[-1], hq, d, generator=torch.Generator().manual_seed(2))).to(dtype).to(DEVICE)
    out = paged_attention_prefill(q, k_cache, v_cache, block_tables, _i32(qsl), _i32(seq_lens), max(query_lens),
                                  d**-0.5, config=config)
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, qsl, seq_lens, d**-0.5)
    assert out.shape == (qsl[-1], hq, d) and out.dtype == dtype
    assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 4.0), (17, 2.5)])
def test_prefill_window_and_softcap(window, softcap):
    query_lens = [12, 40, 1]
    seq_lens = [12, 61, 26]
    qsl = [0, 12, 52, 53]
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, 2, 64, 16, torch.float32, seed=11)
    q = 3 * torch.randn(qsl[-1], 8, 64, device=DEVICE)
    out = paged_attention_prefill(q, k_cache, v_cache, block_tables, _i32(qsl), _i32(seq_lens), max(query_lens),
                                  0.125, window, softcap, config={"BLOCK_M": 32, "BLOCK_N": 16})
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, qsl, seq_lens, 0.125, window, softcap)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_short_chunks_over_long_context_use_splits(window):
    # 2-3 new tokens (speculative verify / tiny chunk): decode-shaped tiles with key splits
    query_lens = [3, 2]
    seq_lens = [75, 40]
    qsl = [0, 3, 5]
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, 2, 64, 16, torch.float32, seed=5)
    q = 3 * torch.randn(qsl[-1], 8, 64, device=DEVICE)
    out = torch.full((5, 8, 64), float("nan"), device=DEVICE)
    paged_attention_prefill(q, k_cache, v_cache, block_tables, _i32(qsl), _i32(seq_lens), 3, 0.125, window,
                            out=out, config={"BLOCK_N": 16, **FORCE_SPLITS})
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, qsl, seq_lens, 0.125, window)
    assert _rel_err(out, ref) < 1e-5


def test_prefill_accepts_strided_q_and_a_loose_max_query_len():
    # q as a view of a fused projection output; max_query_len above the true maximum
    query_lens = [9, 4]
    seq_lens = [9, 20]
    qsl = [0, 9, 13]
    k_cache, v_cache, block_tables = _paged_setup(seq_lens, 2, 64, 16, torch.float32, seed=9)
    fused = torch.randn(13, 4 * 64 + 100, device=DEVICE)
    q = fused[:, : 4 * 64].view(13, 4, 64)
    out = paged_attention_prefill(q, k_cache, v_cache, block_tables, _i32(qsl), _i32(seq_lens), 32, 0.125,
                                  config={"BLOCK_M": 16, "BLOCK_N": 16})
    ref = paged_attention(q, KVCache(k_cache, v_cache), block_tables, qsl, seq_lens, 0.125)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("page,cache_dtype", [(16, torch.float32), (32, torch.float16)])
def test_write_kv_cache_matches_reference(page, cache_dtype):
    T, hkv, d = 11, 3, 40
    k_cache = torch.randn(6, page, hkv, d, device=DEVICE).to(cache_dtype)
    v_cache = torch.randn(6, page, hkv, d, device=DEVICE).to(cache_dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    fused = torch.randn(T, 2 * hkv * d + 8, device=DEVICE)  # k and v as strided views of one projection
    k = fused[:, : hkv * d].view(T, hkv, d)
    v = fused[:, hkv * d : 2 * hkv * d].view(T, hkv, d)
    slots = torch.randperm(6 * page)[:T]
    slots[4] = -1  # a padding token: must not be written
    slots = slots.to(DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    write_kv(KVCache(expect_k, expect_v), k[keep], v[keep], slots[keep])
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


def test_write_then_prefill_then_decode_round_trip():
    # the model's sequence of calls: write the chunk, attend, then decode one more token
    hkv, hq, d, page = 2, 4, 64, 16
    k_cache = torch.zeros(8, page, hkv, d, device=DEVICE)
    v_cache = torch.zeros(8, page, hkv, d, device=DEVICE)
    blocks = [5, 2, 7]
    block_tables = _i32(blocks).view(1, 3)
    n = 20
    k, v, q = (torch.randn(n + 1, h, d, device=DEVICE) for h in (hkv, hkv, hq))
    positions = torch.arange(n + 1)
    slots = (torch.tensor(blocks)[positions // page] * page + positions % page).to(DEVICE)
    write_kv_cache(k[:n], v[:n], k_cache, v_cache, slots[:n])
    pre = paged_attention_prefill(q[:n], k_cache, v_cache, block_tables, _i32([0, n]), _i32([n]), n, 0.125,
                                  config={"BLOCK_M": 16, "BLOCK_N": 16})
    write_kv_cache(k[n:], v[n:], k_cache, v_cache, slots[n:])
    dec = paged_attention_decode(q[n:], k_cache, v_cache, block_tables, _i32([n + 1]), 0.125,
                                 config={"BLOCK_N": 16})
    # dense causal attention over the same tokens
    kk = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=0.125)
    dense = dense.transpose(0, 1)
    assert _rel_err(pre, dense[:n]) < 1e-5
    assert _rel_err(dec, dense[n:]) < 1e-5


def test_value_head_dim_may_differ_from_key_head_dim():
    seq_lens = [7, 40]
    query_lens = [7, 3]
    qsl = [0, 7, 10]
    k_cache, _, block_tables = _paged_setup(seq_lens, 2, 64, 16, torch.float32, seed=13)
    v_cache = torch.randn(*k_cache.shape[:3], 32, device=DEVICE)
    cache = KVCache(k_cache, v_cache)
    q = 3 * torch.randn(10, 4, 64, device=DEVICE)
    pre = paged_attention_prefill(q, k_cache, v_cache, block_tables, _i32(qsl), _i32(seq_lens), max(query_lens),
                                  0.125, config={"BLOCK_M": 16, "BLOCK_N": 16})
    assert _rel_err(pre, paged_attention(q, cache, block_tables, qsl, seq_lens, 0.125)) < 1e-5
    dec = paged_attention_decode(q[:2], k_cache, v_cache, block_tables, _i32(seq_lens), 0.125,
                                 config={"BLOCK_N": 16, **FORCE_SPLITS})
    assert dec.shape == (2, 4, 32)
    assert _rel_err(dec, paged_attention(q[:2], cache, block_tables, [0, 1, 2], seq_lens, 0.125)) < 1e-5
