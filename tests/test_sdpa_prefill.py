"""Fresh-prompt prefill through SDPA equals the paged reference (on CPU via SDPA's math backend)."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from armillary.forward_batch import KVCache
from armillary.kernels.attention import paged_attention, write_kv
from armillary.kernels.sdpa_prefill import fresh_prefill_attention, worth_it


def _setup(lengths: list[int], hq: int, hkv: int, d: int, page: int = 16):
    g = torch.Generator().manual_seed(0)
    blocks_per = [-(-n // page) for n in lengths]
    num_blocks = sum(blocks_per) + 3
    cache = KVCache(torch.zeros(num_blocks, page, hkv, d), torch.zeros(num_blocks, page, hkv, d))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, as the pool hands them out
    tables, slots, at = [], [], 0
    for n, nb in zip(lengths, blocks_per):
        table = perm[at:at + nb]
        at += nb
        tables.append(table + [0] * (max(blocks_per) - nb))
        slots += [table[p // page] * page + p % page for p in range(n)]
    total = sum(lengths)
    q = torch.randn(total, hq, d, generator=g)
    k = torch.randn(total, hkv, d, generator=g)
    v = torch.randn(total, hkv, d, generator=g)
    write_kv(cache, k, v, torch.tensor(slots))
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return q, cache, torch.tensor(tables, dtype=torch.int32), qsl


@pytest.mark.parametrize("lengths,hq,hkv,d", [([63], 4, 2, 60), ([5, 0, 37, 16], 6, 2, 32), ([20], 3, 3, 16)])
def test_fresh_prefill_matches_paged_reference(lengths, hq, hkv, d):
    q, cache, tables, qsl = _setup(lengths, hq, hkv, d)
    got = fresh_prefill_attention(q, cache, tables, qsl, d**-0.5, backends=(SDPBackend.MATH,))
    ref = paged_attention(q, cache, tables, qsl, lengths, d**-0.5)
    assert got is not None
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_refused_backend_returns_none():
    q, cache, tables, qsl = _setup([9], 2, 1, 16)
    # cuDNN takes no CPU tensors: the caller falls back to the paged kernels, and the refusal is remembered
    assert fresh_prefill_attention(q, cache, tables, qsl, 0.25, backends=(SDPBackend.CUDNN_ATTENTION,)) is None
    assert fresh_prefill_attention(q, cache, tables, qsl, 0.25, backends=(SDPBackend.CUDNN_ATTENTION,)) is None


def test_worth_it_only_for_long_fresh_prompts():
    assert worth_it([0], [0, 2048])
    assert not worth_it([0, 0], [0, 100, 200])  # short prompts: one varlen launch is cheaper
    assert not worth_it([0, 512], [0, 2048, 4096])  # a chunk continuing a cached context
    assert not worth_it([], [0])
