"""Prefix caching on long agent conversations (block size 16, checkpoints every 256): follow-up turns compute only new tokens, hashing per admission does not grow.

Scheduler and cache groups only: a follow-up turn computes just its new tokens in as few steps as
the budget allows, a branch resumes at the deepest checkpoint, and the host's hashing per admission
does not grow with the conversation (counted hash calls, not timed)."""
from __future__ import annotations

import random

import pytest
import torch

from armillary.cache_spec import FullAttention, Recurrent
from armillary.memory import prefix_cache, prefix_hash
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.planner import plan_memory
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.sequence import Sequence
from armillary.step_plan import StepOutput, StepPlan

BS, INTERVAL = 16, 256
LAYOUT = [Recurrent(shapes=((3,),), dtypes=(None,))] * 3 + [FullAttention(kv_heads=1, head_dim=4)]


def make(budget: int) -> tuple[Scheduler, CacheCoordinator]:
    plan = plan_memory(LAYOUT, budget_bytes=0, block_size=BS, num_slots=5, dtype=torch.float32, max_model_len=8192,
                       max_num_seqs=4, max_chunk=budget, num_blocks_override=1200, num_snapshots=16)
    cache = CacheCoordinator.from_plan(plan, prefix_caching=True, checkpoint_interval=INTERVAL)
    return Scheduler(4, budget, cache), cache


def tokens(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 30000) for _ in range(n)]


def step(sch: Scheduler) -> StepPlan:
    plan = sch.schedule()
    sch.update_from_output(plan, StepOutput([[7] for _ in plan.sampled]))
    return plan


def run(sch: Scheduler, prompt: list[int], max_tokens: int) -> tuple[Sequence, list[StepPlan]]:
    """Run one request alone to its end; the plans up to its first sampled token."""
    seq = Sequence(f"r{len(prompt)}-{prompt[-1]}", 0, prompt, SamplingParams(max_tokens=max_tokens))
    sch.add(seq)
    plans: list[StepPlan] = []
    while not plans or not plans[-1].sampled:
        plans.append(step(sch))
    while sch.has_unfinished():
        step(sch)
    return seq, plans


@pytest.mark.parametrize("new", [200, 600])
def test_a_follow_up_turn_computes_only_its_new_tokens(new):
    budget = 512
    sch, cache = make(budget)
    first, _ = run(sch, tokens(4000, 1), 8)  # ends having computed 4007 positions (its last token is sampled)
    follow = first.token_ids + tokens(new, 2)
    seq, plans = run(sch, follow, 4)
    assert seq.num_cached_tokens == len(first.token_ids) - 1  # the end-of-turn snapshot, mid-block
    computed = [c.num_tokens for p in plans for c in p.chunks]
    assert sum(computed) == len(follow) - seq.num_cached_tokens  # the new tokens and the last answer token
    assert len(plans) <= -(-sum(computed) // budget) + 1
    if new == 200:  # no stop at the checkpoint 4096, 89 tokens past the resume: one step
        assert computed == [201]
    else:  # a checkpoint an interval past the resume (4352) still ends a chunk and snapshots there
        assert computed == [4352 - 4007, len(follow) - 4352] and plans[0].snapshots
    cache.check_accounting()


def test_a_branch_resumes_at_the_deepest_checkpoint_and_decode_drops_passed_stops():
    sch, cache = make(512)
    prompt = tokens(4000, 3)
    seq = Sequence("a", 0, prompt, SamplingParams(max_tokens=40))
    sch.add(seq)
    while seq.num_computed_tokens < len(prompt):
        step(sch)
    assert seq.chunk_stops == [] and seq.num_computed_tokens == 4000  # decode steps scan no checkpoints
    while sch.has_unfinished():
        step(sch)
    branch, plans = run(sch, prompt[:3900] + tokens(50, 4), 2)  # an edited last message
    assert branch.num_cached_tokens == 3840  # the prompt's last checkpoint ended a chunk (3584 + 256)
    assert [c.num_tokens for p in plans for c in p.chunks] == [3950 - 3840]
    cache.check_accounting()


@pytest.fixture
def hash_calls(monkeypatch):
    calls = [0]
    key = prefix_hash.block_key

    def counted(parent, tokens):
        calls[0] += 1
        return key(parent, tokens)

    monkeypatch.setattr(prefix_hash, "block_key", counted)
    monkeypatch.setattr(prefix_cache, "block_key", counted)
    return calls


@pytest.mark.parametrize("length", [1000, 4000])
def test_hashing_per_admission_does_not_grow_with_the_prompt(hash_calls, length):
    sch, cache = make(8192)
    cold = Sequence("cold", 0, tokens(length, 5), SamplingParams(max_tokens=8))
    sch.add(cold)
    plan = sch.schedule()
    assert hash_calls[0] <= 1  # a miss: block 0, then nothing deeper can hit
    sch.update_from_output(plan, StepOutput([[7]]))
    while sch.has_unfinished():
        step(sch)
    assert hash_calls[0] <= (length + 8) // BS + 1  # each computed block hashed once, plus the end's tail
    before = hash_calls[0]
    follow = Sequence("follow", 0, cold.token_ids + tokens(100, 6), SamplingParams(max_tokens=2))
    sch.add(follow)
    sch.schedule()
    assert follow.num_cached_tokens == length + 7
    assert hash_calls[0] - before <= 3  # block 0, the first block past the last turn's chain, its tail
    cache.check_accounting(sch.running)


def test_conversations_sharing_a_system_prompt_each_reuse_their_own_chain(hash_calls):
    sch, cache = make(8192)
    system = tokens(100, 7)
    a, _ = run(sch, system + tokens(2000, 8), 4)
    b, _ = run(sch, system + tokens(2000, 9), 4)  # ended last, same first block as a
    before = hash_calls[0]
    follow = Sequence("a2", 0, a.token_ids + tokens(50, 10), SamplingParams(max_tokens=2))
    sch.add(follow)
    sch.schedule()
    assert follow.num_cached_tokens == len(a.token_ids) - 1 and hash_calls[0] - before <= 3
    other = Sequence("c", 0, system + tokens(500, 11), SamplingParams(max_tokens=2))  # only the system prompt
    sch.add(other)
    before = hash_calls[0]
    sch.schedule()
    assert other.num_cached_tokens == 0  # its 6 shared blocks are cached, but no state snapshot inside them
    assert hash_calls[0] - before <= 2  # block 0 and the first unshared block: the shared ones are adopted
    cache.check_accounting(sch.running)
