"""Recurrent-state snapshots on a real hybrid model: snapshot a slot at a chunk end, restore it into
another sequence's slot (sharing the prefix's KV blocks), continue: the same logits and tokens as
the uninterrupted run."""
from __future__ import annotations

import torch

from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, build_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _decode(engine, seq: Sequence, first_plan: StepPlan, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Run ``first_plan`` (ends in a sampled chunk of ``seq``), then greedy decode steps; tokens and logits."""
    tokens, logits = [], []
    plan = first_plan
    for _ in range(steps):
        step = engine.worker.launch(plan)
        token = step.wait().token_ids[0][0]
        logits.append(step.logits[0].clone())
        tokens.append(token)
        seq.token_ids.append(token)
        seq.num_computed_tokens = seq.num_scheduled_tokens = len(seq) - 1
        assert engine.cache.allocate(seq, len(seq))
        plan = StepPlan([ScheduledChunk(seq, len(seq) - 1, 1, sample=True)])
    return tokens, logits


def test_snapshot_restore_into_another_slot_then_continue_equals_uninterrupted(tmp_path):
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(tmp_path)
    engine = build_engine(tmp_path, block_size=8, num_kv_blocks=64, max_num_seqs=4, num_state_snapshots=2)
    cache, bs, cut = engine.cache, 8, 16
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()

    # A: prefill to the block-aligned cut, snapshot its state there, prefill the rest, decode
    a = Sequence("a", 0, prompt, GREEDY)
    assert cache.allocate(a, len(a))
    snapshot = cache.recurrent.new_snapshot()
    engine.worker.launch(StepPlan([ScheduledChunk(a, 0, cut, sample=False)], zero_slots=cache.take_fresh_slots(),
                                  snapshots=[(a.state_slot, snapshot)])).wait()
    tokens_a, logits_a = _decode(engine, a, StepPlan([ScheduledChunk(a, cut, len(prompt) - cut, sample=True)]), 8)

    # B: the same prompt, resumed from A's blocks below the cut and the snapshot, in a slot of its own
    b = Sequence("b", 0, prompt, GREEDY)
    b.block_tables = [a.block_table[: cut // bs]]
    for block in b.block_table:
        cache.pool.share(block)
    assert cache.allocate(b, len(b))
    assert b.state_slot != a.state_slot and b.block_table[: cut // bs] == a.block_table[: cut // bs]
    resume = StepPlan([ScheduledChunk(b, cut, len(prompt) - cut, sample=True)], zero_slots=cache.take_fresh_slots(),
                      state_copies=[(snapshot, b.state_slot)])
    tokens_b, logits_b = _decode(engine, b, resume, 8)
    assert tokens_b == tokens_a
    for x, y in zip(logits_a, logits_b):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)

    # and both equal the engine's own uninterrupted greedy run
    engine.add_request("plain", prompt, GREEDY)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.outputs[0].token_ids == tokens_a

    cache.free(a)
    cache.free(b)
    cache.recurrent.free_snapshot(snapshot)
    assert cache.pool.num_used == 0 and cache.recurrent.num_used == 0


def test_state_pool_copies_every_layer_in_one_row():
    """Two recurrent layers, bf16 conv + fp32 SSM states: one row copy moves them all."""
    from armillary.cache_spec import Recurrent
    from armillary.memory.planner import allocate_caches, plan_memory

    layout = [Recurrent(((6, 3), (2, 4, 4)), (None, torch.float32)), None,
              Recurrent(((6, 3), (2, 4, 4)), (None, torch.float32))]
    plan = plan_memory(layout, budget_bytes=1 << 20, block_size=4, num_slots=3, dtype=torch.bfloat16,
                       max_model_len=16, max_num_seqs=2, max_chunk=16, num_snapshots=2)
    caches, pool = allocate_caches(layout, plan, torch.bfloat16, torch.device("cpu"))
    views = [t for c in caches if c is not None for t in c.tensors]
    for i, t in enumerate(views):
        t[1].copy_(torch.randn(t.shape[1:]) + i)
    pool.copy([1], [3])  # slot 1 -> snapshot row 3
    pool.zero([1])
    assert all(bool((t[1] == 0).all()) for t in views)
    pool.copy([3], [0])  # restore into slot 0
    for i, t in enumerate(views):
        assert torch.equal(t[0], t[3]) and not bool((t[0] == 0).all())
