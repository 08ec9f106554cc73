"""The prefix cache's bookkeeping on its own (scheduler and cache groups, no model): the hash chain,
LRU of cached blocks evicted only under pressure, never-cached blocks first, hits that need every
group's blocks and a snapshot, a failed admission that holds nothing, drafts never hashed, hash
collisions that stay misses, and the accounting of blocks, slots and snapshot rows."""
from __future__ import annotations

import torch

from armillary.cache_spec import FullAttention, Recurrent, SlidingWindow
from armillary.memory import prefix_cache, prefix_hash
from armillary.memory.block_pool import BlockPool
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.planner import plan_memory
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepOutput, StepPlan

ATTN = FullAttention(kv_heads=1, head_dim=4)
STATE = Recurrent(shapes=((3,),), dtypes=(None,))
BS = 4


def make(num_blocks=32, layout=(ATTN,), snapshots=0, budget=64, interval=8, max_seqs=4):
    plan = plan_memory(list(layout), budget_bytes=0, block_size=BS, num_slots=max_seqs + 1, dtype=torch.float32,
                       max_model_len=256, max_num_seqs=max_seqs, max_chunk=budget,
                       num_blocks_override=num_blocks + 1, num_snapshots=snapshots)
    cache = CacheCoordinator.from_plan(plan, prefix_caching=True, checkpoint_interval=interval)
    return Scheduler(max_seqs, budget, cache), cache


def seq(tokens: list[int], rid: str = "r", max_tokens: int = 3) -> Sequence:
    return Sequence(rid, 0, tokens, SamplingParams(max_tokens=max_tokens))


def finish_all(sch: Scheduler) -> list[StepPlan]:
    """Run until nothing is left, a token 7 per sampled chunk; the plans it ran."""
    plans = []
    while sch.has_unfinished():
        plan = sch.schedule()
        plans.append(plan)
        sch.update_from_output(plan, StepOutput([[7] for _ in plan.sampled]))
    return plans


def test_hash_chain_keys_stand_for_the_whole_prefix():
    a, b = prefix_hash.HashChain(BS), prefix_hash.HashChain(BS)
    a.extend([1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    b.extend([0, 2, 3, 4, 5, 6, 7, 8], 8)
    assert len(a.keys) == 2 and len(b.keys) == 2
    assert a.keys[1] != b.keys[1]  # same second block, different first block
    assert a.tail([1, 2, 3, 4, 5, 6, 7, 8, 9], 8)[2] == a.keys[1]
    parent, tokens, key = a.tail([1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    assert (parent, tokens) == (a.keys[1], (9,)) and key == prefix_hash.block_key(a.keys[1], (9,))


def test_pool_hands_out_never_cached_blocks_first_and_evicts_the_oldest_cached():
    pool = BlockPool(6, reserved=(0,))
    evicted = []
    pool.on_evict = evicted.append
    a = pool.allocate(3)
    for b in a:
        pool.mark_cached(b)
    pool.release(a)  # a chain's tail is released (and evicted) first
    assert pool.num_free == 5 and pool.num_cached_free == 3 and len(pool.free_ids) == 2
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a) and evicted == []
    pool.touch(a[0])  # a hit takes it out of the LRU
    got = pool.allocate(1)
    assert got == [a[2]] and evicted == [a[2]]
    pool.release([a[0]])
    assert pool.num_cached_free == 2 and pool.num_used == 3


def test_a_finished_prompt_is_hit_by_the_next_one_and_the_tail_is_copied():
    sch, cache = make()
    a = seq(list(range(1, 11)), max_tokens=4)  # 10 prompt tokens + 4 outputs
    sch.add(a)
    finish_all(sch)  # computed 13 positions (the last output is sampled, not computed): 3 blocks + 1
    assert cache.stats()["kv_blocks_used"] == 0 and cache.stats()["kv_blocks_cached"] == 4
    b = seq(a.token_ids + [50, 51])  # prompt + answer + more: resumes at a's end, mid-block
    sch.add(b)
    plan = sch.schedule()
    (src, dst), = plan.block_copies
    assert b.num_cached_tokens == 13 and plan.chunks[0].start == 13 and b.block_table[3] == dst != src
    c = seq(a.token_ids[:12] + [60, 61])  # 3 whole blocks: shared, nothing copied
    sch.add(c)
    plan = sch.schedule()
    assert c.num_cached_tokens == 12 and c.block_table[:3] == b.block_table[:3] and plan.block_copies == []
    cache.check_accounting(sch.running)
    finish_all(sch)
    cache.check_accounting()


def test_failed_admission_after_a_hit_holds_nothing():
    sch, cache = make(num_blocks=6)
    a = seq(list(range(1, 13)), max_tokens=1)
    sch.add(a)
    finish_all(sch)
    hog = seq(list(range(100, 112)), "hog", max_tokens=20)  # takes 3 of the 6, then grows
    sch.add(hog)
    sch.update_from_output(sch.schedule(), StepOutput([[7]]))
    b = seq(list(range(1, 9)) + list(range(200, 220)), "b")  # hits 8, needs 5 more blocks: only 3 free
    sch.add(b)
    plan = sch.schedule()
    assert [c.seq for c in plan.chunks] == [hog] and b.num_computed_tokens == 0 and not any(b.block_tables)
    cache.check_accounting(sch.running)


def test_rejected_drafts_are_never_hashed():
    sch, cache = make()
    a = seq(list(range(1, 8)), max_tokens=10)
    sch.add(a)
    sch.update_from_output(sch.schedule(), StepOutput([[9]]))  # 7 computed, 8 tokens
    registered = len(cache.prefix.block_keys)
    chunk = ScheduledChunk(a, 7, 4, sample=True, draft_tokens=[21, 22, 23])
    a.num_scheduled_tokens = 11
    assert cache.allocate(a, 11)
    sch.update_from_output(StepPlan([chunk]), StepOutput([[30]]))  # no draft accepted
    assert a.num_computed_tokens == 8 and len(cache.prefix.block_keys) == registered + 1  # block [4, 8) only
    assert all(e.tokens != (21, 22, 23) and 21 not in e.tokens for e in cache.prefix.blocks[0].values())
    cache.check_accounting(sch.running)


def test_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(prefix_hash, "block_key", lambda parent, tokens: 7)
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: 7)
    sch, cache = make()
    sch.add(seq(list(range(1, 10)), max_tokens=1))
    finish_all(sch)
    other = seq(list(range(20, 30)))
    sch.add(other)
    sch.schedule()
    assert other.num_cached_tokens == 0


def test_sliding_window_resume_needs_only_the_window():
    from armillary.memory.groups import FullAttentionGroup, SlidingWindowGroup

    pool = BlockPool(9, reserved=(0,))
    assert FullAttentionGroup(0, (0,), pool, 4).blocks_for_resume(13) == range(0, 4)
    assert SlidingWindowGroup(0, (0,), pool, 4, 6, 0).blocks_for_resume(13) == range(2, 4)
    sch, cache = make(layout=(SlidingWindow(kv_heads=1, head_dim=4, window=6),))
    a = seq(list(range(1, 22)), max_tokens=1)
    sch.add(a)
    finish_all(sch)  # blocks before the window went back to the pool, cached
    b = seq(list(range(1, 21)) + [90, 91])
    sch.add(b)
    sch.schedule()
    assert b.num_cached_tokens == 20 and b.block_table[:3] == [0, 0, 0]  # positions < 15 are not read
    cache.check_accounting(sch.running)


def test_hybrid_hits_need_a_snapshot_and_rows_are_accounted_for():
    sch, cache = make(layout=(ATTN, STATE), snapshots=3, interval=8, budget=10)
    a = seq(list(range(1, 20)), max_tokens=2)  # chunks end at the checkpoints 8 and 16; the end at 20
    sch.add(a)
    plans = finish_all(sch)
    assert [c.num_tokens for c in plans[0].chunks] == [8] and plans[0].snapshots
    cache.check_accounting()
    assert cache.stats()["state_snapshots_cached"] == 3 and cache.stats()["state_slots_held"] == 1
    b = seq(list(range(1, 14)) + [70, 71])  # shares 13 tokens: blocks to 12, a snapshot only at 8
    sch.add(b)
    plan = sch.schedule()
    assert b.num_cached_tokens == 8
    assert (cache.recurrent.num_slots, b.state_slot) in plan.state_copies  # the restore of row 0
    assert any(dst >= cache.recurrent.num_slots for _, dst in plan.state_copies)  # a's end copied out
    cache.check_accounting(sch.running)
    finish_all(sch)
    cache.check_accounting()


def test_abort_mid_prefill_keeps_what_was_computed_and_reset_forgets_it():
    sch, cache = make(budget=8)
    a = seq(list(range(1, 30)))
    sch.add(a)
    sch.update_from_output(sch.schedule(), StepOutput([]))  # 8 of 29 computed
    sch.finish(a, "abort")
    cache.check_accounting()
    assert cache.stats()["kv_blocks_cached"] == 2  # the two computed blocks, nothing scheduled beyond
    b = seq(list(range(1, 30)), "b")
    sch.add(b)
    sch.schedule()
    assert b.num_cached_tokens == 8
    sch.finish(b, "abort")
    cache.reset_prefix_cache()
    cache.check_accounting()
    c = seq(list(range(1, 30)), "c")
    sch.add(c)
    sch.schedule()
    assert c.num_cached_tokens == 0 and cache.stats()["kv_blocks_cached"] == 0
