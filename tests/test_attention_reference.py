"""The reference paged attention: its batched decode path and its fused (SDPA) prefill path equal the
explicit float32 math, windowed too."""
from __future__ import annotations

import pytest
import torch

from armillary.forward_batch import KVCache
from armillary.kernels.attention import attend_explicit, attend_fused, gather_kv, paged_attention


@pytest.mark.parametrize("window", [None, 5])
def test_batched_decode_equals_explicit_math_per_sequence(window):
    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 12, 4, 2, 6, 20
    cache = KVCache(torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d))
    seq_lens = [1, 7, 13]
    tables = torch.tensor([[3, 0, 0, 0], [5, 1, 0, 0], [2, 8, 9, 11]], dtype=torch.int32)
    q = torch.randn(3, hq, d)
    batched = paged_attention(q, cache, tables, [0, 1, 2, 3], seq_lens, 0.3, sliding_window=window)
    for b in range(3):
        alone = paged_attention(q[b:b + 1], cache, tables[b:b + 1], [0, 1], seq_lens[b:b + 1], 0.3,
                                sliding_window=window)
        k, v = gather_kv(cache, tables[b], seq_lens[b])
        want = attend_explicit(q[b:b + 1], k, v, 0.3, window)
        torch.testing.assert_close(batched[b:b + 1], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_batched_decode_ignores_non_finite_slots_past_each_length(fp8):
    """Pool memory past a sequence's length is whatever the allocator held (recycled GPU memory: NaN bytes, 0x7F
    in e4m3): the padded block's keys and values must not reach the output (issue 13's NaN logits on the GPU)."""
    torch.manual_seed(1)
    nb, bs, hkv, hq, d = 6, 4, 2, 4, 16
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    clean = KVCache(torch.randn(nb, bs, hkv, d).to(dtype), torch.randn(nb, bs, hkv, d).to(dtype), 0,
                    *((torch.tensor(0.5), torch.tensor(0.25)) if fp8 else (None, None)))
    dirty = KVCache(clean.k.clone(), clean.v.clone(), 0, clean.k_scale, clean.v_scale)
    seq_lens = [5, 2]
    tables = torch.tensor([[1, 4], [3, 0]], dtype=torch.int32)
    for pages in (dirty.k, dirty.v):  # every slot no sequence reaches: NaN
        raw = pages.view(torch.uint8) if fp8 else pages
        raw[4, 1:] = 0x7F if fp8 else float("nan")
        raw[3, 2:] = 0x7F if fp8 else float("nan")
    q = torch.randn(2, hq, d)
    got = paged_attention(q, dirty, tables, [0, 1, 2], seq_lens, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_attention(q, clean, tables, [0, 1, 2], seq_lens, 0.25))


# (new tokens, cached + new): a fresh prompt, a chunk after cached context, one decode token
@pytest.mark.parametrize("n,length", [(13, 13), (6, 19), (1, 17)])
@pytest.mark.parametrize("window", [None, 4, 13, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_explicit(n, length, window, dtype):
    torch.manual_seed(n * 100 + length)
    hq, hkv, d = 6, 2, 24
    q, k, v = (torch.randn(t, h, d).to(dtype) for t, h in ((n, hq), (length, hkv), (length, hkv)))
    want = attend_explicit(q, k, v, 0.2, window)
    got = attend_fused(q, k, v, 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 7])
def test_paged_varlen_equals_explicit_per_sequence(window):
    """A mixed step (fresh prompt, chunk after context, a decode) over scattered blocks, windowed or not,
    against the explicit math on each sequence's gathered keys; the soft-capped path too."""
    torch.manual_seed(1)
    nb, bs, hkv, hq, d = 16, 4, 2, 4, 16
    cache = KVCache(torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d))
    tables = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 9, 11, 12], [4, 6, 8, 10, 0]], dtype=torch.int32)
    qsl, seq_lens = [0, 10, 16, 17], [10, 18, 14]
    q = torch.randn(qsl[-1], hq, d)
    for softcap in (None, 5.0):
        got = paged_attention(q, cache, tables, qsl, seq_lens, 0.25, window, softcap)
        for b in range(3):
            k, v = gather_kv(cache, tables[b], seq_lens[b])
            want = attend_explicit(q[qsl[b]:qsl[b + 1]], k, v, 0.25, window, softcap)
            torch.testing.assert_close(got[qsl[b]:qsl[b + 1]], want, rtol=1e-5, atol=1e-5)


def test_window_convention_is_transformers_mistral():
    """Query at position p sees keys p - window + 1 .. p: exactly ``window`` keys once p >= window - 1."""
    length, window = 9, 3
    q = torch.zeros(length, 1, 4)  # equal scores: the output is the mean of the visible values
    k = torch.zeros(length, 1, 4)
    v = torch.arange(length, dtype=torch.float32)[:, None, None].expand(length, 1, 4).contiguous()
    out = attend_fused(q, k, v, 1.0, window)[:, 0, 0]
    want = torch.tensor([sum(range(max(0, p - window + 1), p + 1)) / min(p + 1, window) for p in range(length)])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(attend_explicit(q, k, v, 1.0, window)[:, 0, 0], want)
