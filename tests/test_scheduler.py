"""Scheduler and pools on their own: budgets, chunking, admission limits, preemption, freeing."""
from __future__ import annotations

import torch

from armillary.memory.block_manager import BlockManager
from armillary.memory.state_pool import StatePool
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.sequence import Sequence, SequenceStatus


def seq(n_prompt: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=100))


def advance(seqs: list[Sequence]) -> None:
    """What the engine does after a step: mark computed, append a token to sequences that sampled."""
    for s in seqs:
        s.num_computed_tokens += s.num_new_tokens
        s.num_new_tokens = 0
        if s.num_computed_tokens == len(s):
            s.token_ids.append(7)


def make(num_blocks=64, block_size=4, slots=8, max_seqs=8, budget=32):
    blocks = BlockManager(num_blocks, block_size)
    states = StatePool(slots, [torch.ones(slots, 3)])
    return Scheduler(max_seqs, budget, blocks, states), blocks, states


def test_block_manager_grow_and_free():
    bm = BlockManager(5, 4)
    s = seq(3)
    assert bm.num_missing(s, 9) == 3
    bm.grow(s, 9)
    assert len(s.block_table) == 3 and bm.num_free == 2
    bm.grow(s, 12)
    assert len(s.block_table) == 3
    assert not bm.can_hold(s, 21)
    bm.free(s)
    assert bm.num_free == 5 and s.block_table == []


def test_state_pool_zeroes_slot_on_allocate():
    t = torch.ones(2, 3)
    pool = StatePool(2, [t])
    a = pool.allocate()
    assert a == 0 and t[0].sum() == 0 and t[1].sum() == 3
    pool.free(a)
    assert pool.num_free == 2


def test_chunked_prefill_and_decode_share_the_budget():
    sch, blocks, _ = make(budget=10)
    long, short = seq(25, "long"), seq(3, "short")
    sch.add(long)
    sch.add(short)
    step = sch.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in step] == [("long", 10)]
    advance(step)
    step = sch.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in step] == [("long", 10)]
    advance(step)
    step = sch.schedule()  # 5 left of long, then short's 3 fit in the same step
    assert [(s.request_id, s.num_new_tokens) for s in step] == [("long", 5), ("short", 3)]
    advance(step)
    step = sch.schedule()  # both decoding
    assert [(s.request_id, s.num_new_tokens) for s in step] == [("long", 1), ("short", 1)]
    assert all(len(s.block_table) == blocks.blocks_for(s.num_computed_tokens + 1) for s in step)


def test_admission_limited_by_max_seqs_and_slots():
    sch, _, states = make(slots=2, max_seqs=3)
    for i in range(4):
        sch.add(seq(2, f"r{i}"))
    step = sch.schedule()
    assert len(step) == 2 and states.num_free == 0 and len(sch.waiting) == 2
    assert {s.state_slot for s in step} == {0, 1}


def test_preemption_by_recompute_frees_the_newest():
    sch, blocks, states = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8, "a"), seq(8, "b")
    sch.add(a)
    sch.add(b)
    advance(sch.schedule())  # each holds 2 full blocks and now has 9 tokens
    step = sch.schedule()  # each needs a 3rd block for token 9: b is preempted for a
    assert [s.request_id for s in step] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.state_slot is None and sch.waiting[0] is b and b.num_preemptions == 1
    assert blocks.num_used == 3 and states.num_used == 1
    assert len(b) == 9  # keeps its generated token for recompute


def test_finish_frees_everything_wherever_the_sequence_is():
    sch, blocks, states = make()
    a, b = seq(5, "a"), seq(5, "b")
    sch.add(a)
    advance(sch.schedule())
    sch.add(b)
    sch.finish(a, "abort")
    sch.finish(b, "abort")
    sch.finish(b, "abort")  # twice is harmless
    assert blocks.num_used == 0 and states.num_used == 0
    assert not sch.has_unfinished() and a.finish_reason == "abort"
