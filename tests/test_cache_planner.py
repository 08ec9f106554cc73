"""The memory planner: layers grouped by spec, several paged groups sharing storage by position over
one block pool, the budget split, and the recurrent rows."""
from __future__ import annotations

import pytest
import torch

from armillary.cache_spec import FullAttention, Recurrent, SlidingWindow
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.groups import SlidingWindowGroup
from armillary.memory.planner import allocate_caches, group_layers, plan_memory
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence

SW = SlidingWindow(kv_heads=2, head_dim=8, window=8)
FULL = FullAttention(kv_heads=2, head_dim=8)
GEMMA_LIKE = [SW, SW, FULL, SW, SW, FULL]  # 4 windowed : 2 global


def _plan(layout, **kw):
    args = dict(budget_bytes=1 << 20, block_size=4, num_slots=3, dtype=torch.float32, max_model_len=64,
                max_num_seqs=2, max_chunk=16)
    return plan_memory(layout, **{**args, **kw})


def test_groups_split_to_equal_layer_counts_and_share_storage_by_position():
    groups, recurrent = group_layers(GEMMA_LIKE, torch.float32)
    assert [g.layers for g in groups] == [(0, 1), (3, 4), (2, 5)] and recurrent == ()
    plan = _plan(GEMMA_LIKE)
    page = 2 * 2 * 8 * 4 * 4  # kv heads × (k + v) × head dim × fp32 bytes × block size
    assert plan.num_positions == 2 and plan.bytes_per_block == 2 * page
    caches, pool = allocate_caches(GEMMA_LIKE, plan, torch.float32, torch.device("cpu"))
    assert pool is None
    assert [c.group for c in caches] == [0, 0, 2, 1, 1, 2]
    # layer j of every subgroup views storage tensor j
    assert caches[0].k is caches[3].k is caches[2].k and caches[1].k is caches[4].k is caches[5].k
    assert caches[0].k is not caches[1].k


def test_one_block_id_serves_whichever_group_holds_it_and_windows_return_theirs():
    plan = _plan(GEMMA_LIKE)
    cache = CacheCoordinator.from_plan(plan)
    assert [type(g).__name__ for g in cache.paged] == ["SlidingWindowGroup", "SlidingWindowGroup",
                                                       "FullAttentionGroup"]
    seq = Sequence("r", 0, list(range(20)), SamplingParams())
    free = cache.pool.num_free
    assert cache.allocate(seq, 20)
    assert [len(t) for t in seq.block_tables] == [5, 5, 5] and cache.pool.num_free == free - 15
    ids = [b for t in seq.block_tables for b in t]
    assert len(set(ids)) == 15  # no id in two groups: each names the same page of all positions
    seq.num_computed_tokens = 20
    cache.release_stale(seq)  # the next query (position 20) reads keys 13..20: blocks 0-2 are stale
    for g in cache.paged:
        held = [b for b in g.table(seq) if b != 0]
        assert len(held) == (2 if isinstance(g, SlidingWindowGroup) else 5)
    assert cache.pool.num_free == free - 9
    cache.free(seq)
    assert cache.pool.num_free == free


def test_pool_caps_at_what_max_num_seqs_can_hold_and_must_hold_one_sequence():
    plan = _plan(GEMMA_LIKE, budget_bytes=1 << 30)
    full_blocks, window_blocks = 64 // 4, -(-(8 + 16) // 4) + 1  # per sequence: global, windowed
    assert plan.num_blocks == 2 * (full_blocks + 2 * window_blocks) + 1  # + the scratch block
    with pytest.raises(MemoryError, match="cannot hold one sequence"):
        _plan(GEMMA_LIKE, budget_bytes=plan.bytes_per_block * 10)


# Gemma 4-like: sliding layers 2 kv heads × 8, global layers 1 kv head × 8 (half the page) or 1 × 16 (same bytes)
HALF = FullAttention(kv_heads=1, head_dim=8)
GEMMA4_LIKE = [SW, SW, HALF, SW, SW, HALF, SW, HALF]


def test_smaller_pages_pack_several_layers_into_one_storage_position():
    groups, _ = group_layers(GEMMA4_LIKE, torch.float32)
    assert [(g.layers, g.per_position) for g in groups] == [((0, 1), 1), ((3, 4), 1), ((6,), 1), ((2, 5, 7), 2)]
    plan = _plan(GEMMA4_LIKE)
    page = 2 * 2 * 8 * 4 * 4  # the sliding page: kv heads × (k + v) × head dim × fp32 × block size
    assert plan.num_positions == 2 and plan.bytes_per_block == 2 * page and not plan.uniform_pages
    caches, _ = allocate_caches(GEMMA4_LIKE, plan, torch.float32, torch.device("cpu"))
    assert caches[2].k.shape == (plan.num_blocks, 4, 1, 8) and caches[0].k.shape == (plan.num_blocks, 4, 2, 8)
    base = {i: caches[i].k.untyped_storage().data_ptr() for i in range(8)}
    assert base[0] == base[3] == base[6] == base[2] == base[5] and base[1] == base[4] == base[7]
    # one block's bytes at position 0: layers 2 and 5 side by side, both inside sliding layer 0's page
    def span(t, block):
        start = t[block].data_ptr()
        return start, start + t[block].numel() * t.element_size()
    spans = sorted(span(caches[i].k, 3) + span(caches[i].v, 3) for i in (2, 5))
    assert spans[0][3] <= spans[1][0]  # layer 2's K and V end before layer 5's start
    lo, hi = span(caches[0].k, 3)[0], span(caches[0].v, 3)[1]
    assert lo == spans[0][0] and hi == spans[1][3]  # and together they fill sliding layer 0's page exactly


def test_block_strided_views_write_and_read_their_own_pages_only():
    from armillary.kernels.attention import gather_kv, write_kv

    plan = _plan(GEMMA4_LIKE)
    caches, _ = allocate_caches(GEMMA4_LIKE, plan, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    written = {}
    for i in (0, 2, 5):  # two global layers sharing a position, and the sliding layer over the same bytes
        heads = caches[i].k.shape[2]
        k, v = torch.randn(6, heads, 8, generator=gen), torch.randn(6, heads, 8, generator=gen)
        blocks = [5, 6] if i == 0 else [7, 9]  # different block ids: different memory, whatever the layer
        slots = torch.tensor([blocks[t // 4] * 4 + t % 4 for t in range(6)])
        write_kv(caches[i], k, v, slots)
        written[i] = (k, v, torch.tensor(blocks))
    for i, (k, v, table) in written.items():
        got_k, got_v = gather_kv(caches[i], table, 6)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_pages_of_one_size_but_another_shape_share_positions_one_each():
    wide = FullAttention(kv_heads=1, head_dim=16)  # same bytes per token as SW, another shape
    groups, _ = group_layers([SW, SW, wide, SW, SW, wide], torch.float32)
    assert [(g.layers, g.per_position) for g in groups] == [((0, 1), 1), ((3, 4), 1), ((2, 5), 1)]
    plan = _plan([SW, SW, wide, SW, SW, wide])
    assert not plan.uniform_pages and _plan(GEMMA_LIKE).uniform_pages
    caches, _ = allocate_caches([SW, SW, wide, SW, SW, wide], plan, torch.float32, torch.device("cpu"))
    assert caches[2].k.shape[2:] == (1, 16) and caches[2].k.stride(0) == 2 * 4 * 16


def test_hybrid_layout_keeps_recurrent_layers_in_one_row_per_slot():
    state = Recurrent(shapes=((6, 3), (2, 4, 4)), dtypes=(None, torch.float32))
    layout = [state, state, state, FULL]
    plan = _plan(layout, num_snapshots=2, dtype=torch.bfloat16)
    assert [g.layers for g in plan.paged_groups] == [(3,)] and plan.recurrent_layers == (0, 1, 2)
    caches, pool = allocate_caches(layout, plan, torch.bfloat16, torch.device("cpu"))
    assert pool.num_rows == plan.num_slots + 2
    conv, ssm = caches[1].tensors
    assert conv.shape == (5, 6, 3) and conv.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    assert conv.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
