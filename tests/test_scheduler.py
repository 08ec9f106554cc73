"""Scheduler and cache groups on their own: budgets, chunking, admission, preemption, freeing,
step plans that accept fewer positions than they scheduled, sliding windows, chunk stops."""
from __future__ import annotations

import torch

from armillary.cache_spec import FullAttention, Recurrent, SlidingWindow
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.planner import plan_memory
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.sequence import Sequence, SequenceStatus
from armillary.step_plan import ScheduledChunk, StepOutput, StepPlan

ATTN = FullAttention(kv_heads=1, head_dim=4)
STATE = Recurrent(shapes=((3,),), dtypes=(None,))


def seq(n_prompt: int, rid: str = "r", max_tokens: int = 100) -> Sequence:
    return Sequence(rid, 0, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def make(num_blocks=64, block_size=4, slots=8, max_seqs=8, budget=32, layout=(ATTN, STATE), snapshots=0):
    """A scheduler over real cache groups; ``num_blocks`` usable blocks (+ the scratch block)."""
    plan = plan_memory(list(layout), budget_bytes=0, block_size=block_size, num_slots=slots + 1,
                       dtype=torch.float32, max_model_len=1024, max_num_seqs=max_seqs, max_chunk=budget,
                       num_blocks_override=num_blocks + 1, num_snapshots=snapshots)
    cache = CacheCoordinator.from_plan(plan)
    return Scheduler(max_seqs, budget, cache), cache


def run(sch: Scheduler, plan: StepPlan, token: int = 7) -> list[Sequence]:
    """What the worker would give back: one token per sampled chunk."""
    return sch.update_from_output(plan, StepOutput([[token] for _ in plan.sampled]))


def shape(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in plan.chunks]


def test_block_pool_and_full_group_grow_trim_free():
    sch, cache = make(num_blocks=5, block_size=4)
    s = seq(3)
    assert cache.blocks_needed(s, 9) == 3
    assert cache.allocate(s, 9) and len(s.block_table) == 3 and cache.pool.num_free == 2
    assert cache.allocate(s, 12) and len(s.block_table) == 3
    assert not cache.allocate(s, 21) and len(s.block_table) == 3  # nothing taken on failure
    cache.trim(s, 4)
    assert len(s.block_table) == 1 and cache.pool.num_free == 4
    cache.free(s)
    assert cache.pool.num_free == 5 and s.block_table == [] and s.state_slot is None


def test_chunked_prefill_and_decode_share_the_budget():
    sch, cache = make(budget=10)
    long, short = seq(25, "long"), seq(3, "short")
    sch.add(long)
    sch.add(short)
    plan = sch.schedule()
    assert shape(plan) == [("long", 10)] and not plan.chunks[0].sample
    run(sch, plan)
    assert long.num_computed_tokens == 10 and len(long) == 25
    plan = sch.schedule()
    assert shape(plan) == [("long", 10)]
    run(sch, plan)
    plan = sch.schedule()  # 5 left of long, then short's 3 fit in the same step
    assert shape(plan) == [("long", 5), ("short", 3)] and all(c.sample for c in plan.chunks)
    run(sch, plan)
    plan = sch.schedule()  # both decoding
    assert shape(plan) == [("long", 1), ("short", 1)]
    assert [c.start for c in plan.chunks] == [25, 3]
    assert all(len(s.block_table) == -(-(s.num_computed_tokens + 1) // 4) for s in plan.seqs)


def test_admission_limited_by_max_seqs_and_slots_and_fresh_slots_are_zeroed():
    sch, cache = make(slots=2, max_seqs=3)
    for i in range(4):
        sch.add(seq(2, f"r{i}"))
    plan = sch.schedule()
    assert len(plan.chunks) == 2 and cache.recurrent.num_free == 0 and len(sch.waiting) == 2
    assert {s.state_slot for s in plan.seqs} == {0, 1} and sorted(plan.zero_slots) == [0, 1]
    assert sch.schedule().zero_slots == []  # handed out once, zeroed once


def test_failed_admission_holds_nothing():
    """Blocks fit but no state slot is free: the coordinator takes neither."""
    sch, cache = make(slots=1, max_seqs=4)
    sch.add(seq(4, "a"))
    sch.add(seq(4, "b"))
    sch.schedule()
    b = sch.waiting[0]
    assert b.block_tables in ([], [[]]) and b.state_slot is None
    assert cache.pool.num_used == 1  # a's one block


def test_preemption_by_recompute_frees_the_newest():
    sch, cache = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8, "a"), seq(8, "b")
    sch.add(a)
    sch.add(b)
    run(sch, sch.schedule())  # each holds 2 full blocks and now has 9 tokens
    plan = sch.schedule()  # each needs a 3rd block for token 9: b is preempted for a
    assert [s.request_id for s in plan.seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.state_slot is None and sch.waiting[0] is b and b.num_preemptions == 1
    assert cache.pool.num_used == 3 and cache.recurrent.num_used == 1
    assert len(b) == 9  # keeps its generated token for recompute


def test_finish_frees_everything_wherever_the_sequence_is():
    sch, cache = make()
    a, b = seq(5, "a"), seq(5, "b")
    sch.add(a)
    run(sch, sch.schedule())
    sch.add(b)
    sch.finish(a, "abort")
    sch.finish(b, "abort")
    sch.finish(b, "abort")  # twice is harmless
    assert cache.pool.num_used == 0 and cache.recurrent.num_used == 0
    assert not sch.has_unfinished() and a.finish_reason == "abort"


def _holdings(cache: CacheCoordinator, s: Sequence) -> tuple:
    return (s.num_computed_tokens, s.num_scheduled_tokens, len(s.block_table), cache.pool.num_used, s.state_slot,
            len(s))


def test_plan_with_k_plus_1_positions_accepting_fewer_equals_running_only_the_accepted():
    """Verify 1 + K positions, accept a of K drafts: blocks, slot and counts as if 1 + a tokens had run."""
    k, bs = 5, 4
    for accepted in range(k + 1):
        sch, cache = make(block_size=bs, budget=64)
        ref_sch, ref_cache = make(block_size=bs, budget=64)
        s, ref = seq(6, "s"), seq(6, "ref")
        for sc, x in ((sch, s), (ref_sch, ref)):
            sc.add(x)
            run(sc, sc.schedule())  # prefill; 7 tokens, 6 computed
        drafts = [50 + i for i in range(k)]
        # the verify step: the pending token and K drafts, positions 6..6+K, through the real scheduler hooks
        assert cache.allocate(s, s.num_computed_tokens + 1 + k)
        chunk = ScheduledChunk(s, s.num_computed_tokens, 1 + k, sample=True, draft_tokens=drafts)
        s.num_scheduled_tokens = chunk.end
        bonus = 90
        got = sch.update_from_output(StepPlan([chunk]), StepOutput([drafts[:accepted] + [bonus]]))
        assert got == [s]
        # the reference decodes the same tokens one at a time
        for token in drafts[:accepted] + [bonus]:
            run(ref_sch, ref_sch.schedule(), token)
        assert s.token_ids == ref.token_ids
        assert _holdings(cache, s) == _holdings(ref_cache, ref), accepted
        plan = sch.schedule()  # and the next step starts right after the accepted positions
        assert plan.chunks[0].start == s.num_computed_tokens == 7 + accepted


def test_update_skips_sequences_finished_meanwhile():
    sch, cache = make()
    a = seq(3, "a")
    sch.add(a)
    plan = sch.schedule()
    sch.finish(a, "abort")
    assert run(sch, plan) == [] and len(a) == 3 and cache.pool.num_used == 0


def test_async_continuation_schedules_ahead_of_the_computed_count():
    sch, cache = make(block_size=4)
    a = seq(4, "a")
    sch.add(a)
    first = sch.schedule()  # prefill 0..3, samples token 4
    cont = sch.schedule_continuation([a], torch.tensor([0]))  # position 4 while token 4 is sampled
    assert cont.chunks[0].start == 4 and a.num_scheduled_tokens == 5 and a.num_computed_tokens == 0
    assert len(a.block_table) == 2
    run(sch, first, 11)
    assert a.num_computed_tokens == 4 and a.token_ids[-1] == 11
    run(sch, cont, 12)
    assert a.num_computed_tokens == 5 and a.token_ids[-2:] == [11, 12]


def test_length_finish_in_update():
    sch, cache = make()
    a = seq(2, "a", max_tokens=2)
    sch.add(a)
    run(sch, sch.schedule())
    run(sch, sch.schedule())
    assert a.finish_reason == "length" and a.num_output_tokens == 2 and cache.pool.num_used == 0


def test_sliding_window_group_returns_blocks_that_left_the_window():
    window, bs = 8, 4
    sch, cache = make(block_size=bs, budget=64, layout=(SlidingWindow(kv_heads=1, head_dim=4, window=window),))
    a = seq(3, "a", max_tokens=60)
    sch.add(a)
    most = 0
    for _ in range(60):
        run(sch, sch.schedule())
        held = [b for b in a.block_table if b != 0]
        most = max(most, len(held))
        if a.is_finished:
            break
        # every position the next query can read (p - window, p] is still held
        p = a.num_computed_tokens
        for pos in range(max(0, p - window + 1), p):
            assert a.block_table[pos // bs] != 0
    assert most <= window // bs + 2 and cache.pool.num_used == 0


def test_prefill_chunks_end_at_chunk_stops_and_snapshot_there():
    sch, cache = make(block_size=4, budget=64, snapshots=2)
    a = seq(20, "a")
    a.chunk_stops = [8, 16]
    sch.max_num_batched_tokens = 12  # the first chunk reaches 8, not 16
    sch.add(a)
    plan = sch.schedule()
    assert shape(plan) == [("a", 8)] and plan.snapshots == [(a.state_slot, cache.recurrent.num_slots)]
    run(sch, plan)
    sch.max_num_batched_tokens = 64  # a chunk ends at the deepest stop it reaches
    plan = sch.schedule()
    assert shape(plan) == [("a", 8)] and len(plan.snapshots) == 1
    run(sch, plan)
    plan = sch.schedule()
    assert shape(plan) == [("a", 4)] and plan.snapshots == [] and set(a.snapshots) == {8, 16}
    assert cache.recurrent.num_free_snapshots == 0
    sch.finish(a, "abort")
    assert cache.recurrent.num_free_snapshots == 2 and a.snapshots == {}
