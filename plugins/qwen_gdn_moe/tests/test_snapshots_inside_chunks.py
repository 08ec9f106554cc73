"""Prefix-cache checkpoints inside a prefill chunk (``snapshots_inside_chunks``): one step where ending the
chunk at the checkpoint took two, the snapshot row what the two-step run leaves there (conv
window and delta-rule state, every layer, to fp32 rounding), the outputs the same; on the reference and the
Triton paths."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import ops
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, build_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("inside_chunks")
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(directory)
    return directory


def _prompt(n: int, seed: int = 5) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("cut, decodes", [(16, 0), (2, 1)])  # a checkpoint 2 tokens in: the window spans the step
def test_snapshot_inside_a_chunk_equals_the_chunk_ended_there(model_dir, backend, cut, decodes):
    engine = build_engine(model_dir, block_size=8, num_kv_blocks=64, max_num_seqs=4, num_state_snapshots=2,
                          kernel_backend=backend, enforce_eager=True)
    try:
        cache, runner = engine.cache, engine.worker.runner
        rows = runner.states.buffer
        prompt = _prompt(37)
        # a decode-shaped sequence in the same step (its own slot) when ``decodes``: the split keeps it whole
        other = Sequence("o", 0, _prompt(9, seed=6), GREEDY)
        if decodes:
            assert cache.allocate(other, len(other))
            engine.worker.launch(StepPlan([ScheduledChunk(other, 0, 8, sample=False)],
                                          zero_slots=cache.take_fresh_slots())).wait()

        def with_other(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
            return chunks + ([ScheduledChunk(other, 8, 1, sample=True)] if decodes else [])

        # A: one chunk of the whole prompt, its state saved after ``cut`` tokens by the layers themselves
        a = Sequence("a", 0, prompt, GREEDY)
        assert cache.allocate(a, len(a))
        row_a = cache.recurrent.new_snapshot()
        step = engine.worker.launch(StepPlan(with_other([ScheduledChunk(a, 0, len(prompt), sample=True,
                                                                        snapshot=(cut, row_a))]),
                                             zero_slots=cache.take_fresh_slots()))
        step.wait()
        logits_a = step.logits[0].clone()
        saved_a = rows[row_a].clone()

        # B: the chunk ended at the checkpoint (the slot copied to the row after that step), then the rest
        b = Sequence("b", 0, prompt, GREEDY)
        assert cache.allocate(b, len(b))
        row_b = cache.recurrent.new_snapshot()
        engine.worker.launch(StepPlan([ScheduledChunk(b, 0, cut, sample=False)], zero_slots=cache.take_fresh_slots(),
                                      snapshots=[(b.state_slot, row_b)])).wait()
        step = engine.worker.launch(StepPlan([ScheduledChunk(b, cut, len(prompt) - cut, sample=True)]))
        step.wait()
        # every layer's conv window and state; fp32 rounding apart (the steps' GEMMs see other row counts)
        snap_a, snap_b, end = (t.view(torch.float32) for t in (saved_a, rows[row_b], rows[a.state_slot]))
        torch.testing.assert_close(snap_a, snap_b, rtol=1e-5, atol=1e-5)
        assert (snap_a - end).abs().max() > 1e-2  # the checkpoint's state, not the chunk end's
        torch.testing.assert_close(step.logits[0], logits_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows[b.state_slot].view(torch.float32), rows[a.state_slot].view(torch.float32),
                                   rtol=1e-5, atol=1e-6)
        for seq in (a, b) + ((other,) if decodes else ()):
            cache.free(seq)
        for row in (row_a, row_b):
            cache.recurrent.free_snapshot(row)
        assert cache.pool.num_used == 0 and cache.recurrent.num_used == 0
    finally:
        ops.set_backend("auto")


def test_the_scheduler_keeps_the_chunk_whole_and_the_hit_equals_a_miss(model_dir):
    """Through the engine: a 44-token prompt with checkpoints every 16 runs in one prefill step (two before),
    and a second prompt sharing 35 tokens hits the checkpoint at 32 saved inside that step."""
    def engine(prefix: bool):
        return build_engine(model_dir, block_size=8, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=64,
                            enable_prefix_caching=prefix, state_checkpoint_interval=16,
                            num_state_snapshots=8 if prefix else 0)

    def run(eng, prompt):
        plans = []
        schedule = eng.scheduler.schedule

        def spy():
            plan = schedule()
            plans.append(plan)
            return plan

        eng.scheduler.schedule = spy
        eng.add_request(f"r{len(prompt)}-{prompt[-1]}", prompt, GREEDY)
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
        eng.scheduler.schedule = schedule
        eng.cache.check_accounting([])
        return out, plans

    shared = _prompt(35, seed=1)
    eng = engine(True)
    assert eng.scheduler.snapshots_inside_chunks
    _, plans = run(eng, shared + _prompt(9, seed=2))
    prefill = [c for p in plans for c in p.chunks if c.num_tokens > 1]
    assert [(c.start, c.num_tokens) for c in prefill] == [(0, 44)]
    assert prefill[0].snapshot is not None and prefill[0].snapshot[0] == 32
    cut = engine(True)
    cut.scheduler.snapshots_inside_chunks = False  # a model that cannot: the chunk ends at the checkpoint
    _, plans = run(cut, shared + _prompt(9, seed=2))
    assert [(c.start, c.num_tokens) for p in plans for c in p.chunks if c.num_tokens > 1] == [(0, 32), (32, 12)]
    other = shared + _prompt(7, seed=3)
    got, _ = run(eng, other)
    assert got.num_cached_tokens == 32
    want, _ = run(engine(False), other)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
