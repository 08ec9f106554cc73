"""A decode step staged into the CUDA-graph buffers equals the batch ``ModelRunner.prepare`` builds.

Staging (pinned host buffers, packed copies, padding rows) needs no GPU, so it is checked on the CPU.
"""
from __future__ import annotations

import torch

from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.model_runner import ModelRunner
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan

BLOCK = 4


def _decoding(length: int, table: list[int], slot: int, other_table: list[int] | None = None) -> ScheduledChunk:
    seq = Sequence("r", 0, list(range(100, 100 + length)), SamplingParams())
    seq.num_computed_tokens = length - 1
    seq.block_tables = [table] + ([other_table] if other_table is not None else [])
    seq.state_slot = slot
    return ScheduledChunk(seq, length - 1, 1, sample=True)


def test_staged_rows_equal_prepare_and_padding_points_at_scratch():
    graphs = CUDAGraphDecoder(None, [], max_batch=8, max_blocks_per_seq=6, block_size=BLOCK, scratch_block=40,
                              scratch_slot=7, device=torch.device("cpu"))
    runner = ModelRunner(None, [], BLOCK, torch.device("cpu"))
    big = [_decoding(n, list(range(10 * i, 10 * i + -(-n // BLOCK))), i) for i, n in enumerate([9, 3, 17, 5, 2])]
    graphs.stage(StepPlan(big))  # a larger step first: its rows must not leak into the next step's padding
    plan = StepPlan([_decoding(6, [3, 11], 2), _decoding(13, [5, 1, 8, 2], 4), _decoding(1, [9], 0)])
    batch, bucket = graphs.stage(plan)
    ref = runner.prepare(plan)
    assert bucket == 4 and torch.equal(ref.logits_indices, torch.arange(3))
    for name in ("input_ids", "positions", "slot_mapping", "state_slots", "context_lens", "seq_lens"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name
    assert torch.equal(batch.block_tables[:, : ref.block_tables.shape[1]], ref.block_tables)
    assert batch.is_decode_only and batch.num_seqs == 3
    pad = 3  # the bucket's fourth row: a 1-token sequence in the scratch block and slot
    assert graphs.input_ids[pad] == 0 and graphs.positions[pad] == 0 and graphs.context_lens[pad] == 0
    assert graphs.seq_lens[pad] == 1 and graphs.slot_mapping[pad] == 40 * BLOCK and graphs.state_slots[pad] == 7


def test_can_run_only_single_token_steps_within_the_largest_bucket():
    graphs = CUDAGraphDecoder(None, [], max_batch=2, max_blocks_per_seq=2, block_size=BLOCK, scratch_block=9,
                              scratch_slot=3, device=torch.device("cpu"))
    graphs.graphs[2] = object()  # as if captured
    one = _decoding(3, [0], 0)
    assert graphs.can_run(StepPlan([one])) and graphs.can_run(StepPlan([one, one]))
    assert not graphs.can_run(StepPlan([one, one, one]))
    chunk = ScheduledChunk(one.seq, 1, 2, sample=True)
    assert not graphs.can_run(StepPlan([one, chunk]))
    drafted = ScheduledChunk(one.seq, 2, 1, sample=True, draft_tokens=[5])
    assert not graphs.can_run(StepPlan([drafted]))


def test_two_cache_groups_stage_their_own_tables_and_slots():
    graphs = CUDAGraphDecoder(None, [], max_batch=4, max_blocks_per_seq=6, block_size=BLOCK, scratch_block=0,
                              scratch_slot=3, device=torch.device("cpu"), num_groups=2)
    runner = ModelRunner(None, [], BLOCK, torch.device("cpu"), num_groups=2)
    plan = StepPlan([_decoding(6, [3, 11], 2, [0, 7]), _decoding(9, [5, 1, 8], 1, [0, 0, 4])])
    batch, bucket = graphs.stage(plan)
    ref = runner.prepare(plan)
    assert bucket == 2 and batch.query_start_loc_cpu is None and batch.seq_lens_cpu is None
    for g in range(2):
        assert torch.equal(batch.group_slot_mappings[g], ref.group_slot_mappings[g])
        width = ref.group_block_tables[g].shape[1]
        assert torch.equal(batch.group_block_tables[g][:, :width], ref.group_block_tables[g])
    assert ref.group_slot_mappings[1].tolist() == [7 * BLOCK + 1, 4 * BLOCK + 0]
