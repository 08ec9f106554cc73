"""Scheduling policies: the step-time model, slai's deadline-sized prefill chunks under a simulated
step cost, short prompts first, no starvation, and greedy output under slai equal to fcfs on a tiny
Llama with 8 concurrent requests (blocks and slots all freed, the engine's step timing fed)."""
from __future__ import annotations

import time

import pytest
import torch

import armillary_llama.hooks as llama_hooks
from armillary import LLM, SamplingParams
from armillary.cache_spec import FullAttention, Recurrent
from armillary.config import SCHEDULING_POLICIES, EngineConfig
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.planner import plan_memory
from armillary.registry import PluginRegistry
from armillary.scheduler import Scheduler
from armillary.scheduling_policy import POLICY_NAMES, SchedulingPolicy, SlaiPolicy, StepTimeModel, build_policy
from armillary.sequence import Sequence
from armillary.step_plan import StepOutput, StepPlan

LAYOUT = [FullAttention(kv_heads=1, head_dim=4), Recurrent(shapes=((3,),), dtypes=(None,))]


def step_cost(num_tokens: int) -> float:
    """The simulated device: 2 ms a step plus 50 us a token."""
    return 0.002 + 0.00005 * num_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy: SchedulingPolicy, budget: int = 2048, max_seqs: int = 16, num_blocks: int = 1024):
    plan = plan_memory(LAYOUT, budget_bytes=0, block_size=16, num_slots=max_seqs + 1, dtype=torch.float32,
                       max_model_len=8192, max_num_seqs=max_seqs, max_chunk=budget,
                       num_blocks_override=num_blocks + 1)
    cache = CacheCoordinator.from_plan(plan)
    return Scheduler(max_seqs, budget, cache, policy=policy), cache


def seq(n_prompt: int, rid: str, arrival: float, max_tokens: int = 1000) -> Sequence:
    return Sequence(rid, 0, [1 + i % 50 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                    arrival=arrival)


def simulate(sch: Scheduler, clock: Clock) -> StepPlan:
    """One step on the simulated device: plan, charge its cost to the clock, report it, one token per sample."""
    plan = sch.schedule()
    seconds = step_cost(plan.num_tokens)
    clock.now += seconds
    sch.policy.observe_step(plan.num_tokens, seconds, plan)
    sch.update_from_output(plan, StepOutput([[7] for _ in plan.sampled]))
    return plan


def test_policy_names_and_unknown_policy_errors():
    assert POLICY_NAMES == SCHEDULING_POLICIES
    assert build_policy("fcfs", 50).name == "fcfs" and build_policy("slai", 50).tbt_deadline_s == 0.05
    with pytest.raises(ValueError, match="unknown scheduling policy 'edf'"):
        build_policy("edf", 50)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, slai"):
        EngineConfig(model="m", scheduling_policy="edf").validate()
    with pytest.raises(ValueError, match="tbt_deadline_ms"):
        EngineConfig(model="m", scheduling_policy="slai", tbt_deadline_ms=0).validate()
    assert EngineConfig(model="m").scheduling_policy == "fcfs"


def test_step_time_model_interpolates_errs_slow_and_ignores_outliers():
    model = StepTimeModel()
    assert model.predict(100) is None and model.tokens_within(1.0, 100) is None
    for n in (8, 256, 1024):
        for _ in range(3):
            model.observe(n, step_cost(n))
    model.observe(256, 5.0)  # a compile: the median of 256's bucket does not move
    assert model.predict(256) == pytest.approx(step_cost(256))
    assert model.predict(600) == pytest.approx(step_cost(600))  # linear between measured points
    fixed, per_token = model.line()  # the fixed cost is learned, not assumed away
    assert fixed == pytest.approx(0.002) and per_token == pytest.approx(0.00005)
    assert model.predict(1) == pytest.approx(step_cost(1))  # below the first point: down the line
    assert model.predict(4096) == pytest.approx(step_cost(4096))  # above the last: up the line, not in proportion
    fits = model.tokens_within(0.03, 2048)
    assert step_cost(fits) <= 0.03 < step_cost(fits + 1)
    model.observe(100, 0.5)  # a slow small step makes every larger count at least as slow
    assert model.predict(256) >= 0.5 and model.tokens_within(0.03, 2048) < 100
    one = StepTimeModel()
    one.observe(100, 0.01)  # one point: its time below it, in proportion above it (no line to follow yet)
    assert one.line() is None and one.predict(10) == 0.01 and one.predict(300) == pytest.approx(0.03)


def test_slai_sizes_prefill_chunks_to_the_deadline_while_streams_decode():
    deadline = 0.02  # 20 ms: 360 tokens a step on the simulated device
    clock = Clock()
    sch, cache = make(SlaiPolicy(deadline, clock=clock))
    streams = [seq(40, f"d{i}", clock.now) for i in range(8)]
    for s in streams:
        sch.add(s)
    simulate(sch, clock)  # the 8 prompts in one step: nobody decodes yet, full budget
    for _ in range(3):
        assert simulate(sch, clock).is_decode_only
    long = seq(6000, "long", clock.now, max_tokens=4)
    sch.add(long)
    ideal = 360 - len(streams)  # the most prefill tokens an on-time step holds
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        plan = simulate(sch, clock)
        assert [c.seq for c in plan.chunks if c.seq is not long] == streams  # every stream gets its token each step
        assert step_cost(plan.num_tokens) <= deadline  # the actual cost: the prediction erred slow
        chunks += [c.num_tokens for c in plan.chunks if c.seq is long]
    assert chunks[0] <= ideal  # learned from a 320-token prefill step and the decode-only steps
    assert all(n >= 0.9 * ideal for n in chunks[3:-1])  # then close to the deadline
    # fcfs would have spent the whole 2048-token budget: a 104 ms step for every stream
    fcfs, _ = make(SchedulingPolicy())
    for s in [seq(40, f"d{i}", 0.0) for i in range(8)] + [seq(6000, "long", 0.0)]:
        fcfs.add(s)
    first = fcfs.schedule()
    fcfs.update_from_output(first, StepOutput([[7] for _ in first.sampled]))
    assert step_cost(fcfs.schedule().num_tokens) > 4 * deadline
    for s in list(sch.running):
        sch.finish(s, "abort")
    cache.check_accounting([])


def test_a_short_prompt_behind_a_long_one_is_served_first():
    clock = Clock()
    for policy, want_first in ((SchedulingPolicy(), False), (SlaiPolicy(1.0, clock=clock), True)):
        sch, cache = make(policy, budget=256)
        long, short = seq(2000, "long", clock.now), seq(30, "short", clock.now + 0.001)
        sch.add(long)
        sch.add(short)
        plan = simulate(sch, clock)  # both waiting: slai admits the short one first
        assert (short in plan.seqs and short.num_output_tokens == 1) is want_first
        late = seq(20, "late", clock.now)
        sch.add(late)  # arrives while the long prompt is mid-prefill
        plan = simulate(sch, clock)
        if want_first:
            # the long chunk: 256 - 1 for short's decode - 20 left for late
            assert late.num_output_tokens == 1 and [c.num_tokens for c in plan.chunks if c.seq is long] == [235]
        else:
            assert late.num_output_tokens == 0 and plan.seqs == [long]
        for s in list(sch.running) + list(sch.waiting):
            sch.finish(s, "abort")
        cache.check_accounting([])


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    clock = Clock()
    policy = SlaiPolicy(1.0, max_wait_s=0.5, clock=clock)
    sch, cache = make(policy, budget=64)
    long = seq(300, "long", clock.now, max_tokens=2)
    sch.add(long)
    steps, shorts = 0, []
    while not long.is_finished:
        clock.now += 0.01  # shorts arrive every 10 ms, each filling the prefill budget
        shorts.append(seq(60, f"s{steps}", clock.now, max_tokens=2))
        sch.add(shorts[-1])
        simulate(sch, clock)
        steps += 1
        if clock.now - long.arrival < 0.5:  # not due yet: each short is served in the step it arrives
            assert shorts[-1].num_output_tokens == 1 and long.num_computed_tokens <= 4 * steps  # leftovers only
        assert steps < 200
    assert steps <= 0.5 / 0.01 + 300 / (64 - 8) + 4  # once due it goes first at full chunks
    while sch.has_unfinished():
        simulate(sch, clock)
    assert all(s.is_finished for s in shorts)
    cache.check_accounting([])


BS = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.08)
    directory = tmp_path_factory.mktemp("policy_llama")
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory, 160


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny hybrid Qwen3-Next (GDN state slots beside the paged attention)."""
    from plugins.qwen_gdn_moe.tests.hf_models import VOCAB
    from tests.fixtures.tiny_models import save_tiny_model

    directory = tmp_path_factory.mktemp("policy_qwen")
    save_tiny_model(directory, tokenizer=False)
    return directory, VOCAB


def registry_for(kind: str) -> PluginRegistry:
    if kind == "qwen":
        from plugins.qwen_gdn_moe.tests.harness import qwen_registry

        return qwen_registry()
    registry = PluginRegistry()
    registry.register(llama_hooks, "llama", distribution="armillary-llama")
    return registry


def run_engine(kind: str, checkpoint: tuple, policy: str, async_scheduling: bool = False):
    """8 concurrent greedy requests, chunked prefill; outputs, the plans run, and what the policy was told."""
    model_dir, vocab = checkpoint
    llm = LLM(str(model_dir), registry=registry_for(kind), dtype="float32", device="cpu", max_model_len=256,
              block_size=BS, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=96, scheduling_policy=policy,
              tbt_deadline_ms=1000 * step_cost(16), async_scheduling=async_scheduling)
    engine = llm.engine
    sch = engine.scheduler
    if policy == "slai":
        sch.policy.min_prefill_tokens = 5
    plans, told = [], []
    schedule, observe = sch.schedule, sch.policy.observe_step
    sch.schedule = lambda: plans.append(schedule()) or plans[-1]
    # the policy learns the simulated device (a deadline of 16 tokens a step), whatever this CPU's steps take
    sch.policy.observe_step = lambda n, s, plan: told.append((n, s)) or observe(n, step_cost(n), plan)
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (70, 9, 33, 5, 61, 17, 44, 12)]
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    # steps overlap under async scheduling, their measured times do not: together within the wall time
    assert sum(seconds for _, seconds in told) <= time.perf_counter() - started
    engine.cache.check_accounting(list(sch.running))  # every block and state slot back
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats.get("state_slots_used", 0) == 0
    return [o.outputs[0].token_ids for o in outs], plans, told


@pytest.mark.parametrize("kind,async_scheduling", [("llama", False), ("llama", True), ("qwen", False)])
def test_greedy_output_under_slai_equals_fcfs(request, kind, async_scheduling):
    checkpoint = request.getfixturevalue(f"{kind}_dir")
    want, fcfs_plans, _ = run_engine(kind, checkpoint, "fcfs", async_scheduling)
    got, plans, told = run_engine(kind, checkpoint, "slai", async_scheduling)
    assert got == want and all(len(t) == 10 for t in got)
    mixed = [p for p in plans if p and not p.is_decode_only and any(c.is_decode for c in p.chunks)]
    assert len(mixed) > 2 and all(p.num_tokens <= 16 for p in mixed[2:])  # after two sizes measured: on time
    assert max(p.num_tokens for p in fcfs_plans) == 48  # fcfs fills the budget; slai held prefill back
    if not async_scheduling:  # every planned step reported, with its token count and a wall time
        assert [n for n, _ in told] == [p.num_tokens for p in plans if p]
    assert len(told) >= len([p for p in plans if p]) and all(s > 0 for _, s in told)
