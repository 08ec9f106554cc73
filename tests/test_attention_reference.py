"""The reference paged attention's batched decode path equals its per-sequence path."""
from __future__ import annotations

import pytest
import torch

from armillary.forward_batch import KVCache
from armillary.kernels.attention import paged_attention


@pytest.mark.parametrize("window", [None, 5])
def test_batched_decode_equals_one_sequence_at_a_time(window):
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
        torch.testing.assert_close(batched[b:b + 1], alone, rtol=1e-5, atol=1e-5)
