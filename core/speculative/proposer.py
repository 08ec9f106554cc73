"""Draft tokens from the model's own draft head (MTP), run on the device right after the verify forward.

The head at position ``q`` reads the token at ``q + 1`` and the main model's hidden state at
``q``, and predicts the token at ``q + 2``. Pass 1 runs over every position of the step (so the
head's KV cache covers every computed position, prefill included), fed the token after each:
the next prompt token, the drafts, or the tokens the step emitted. Its output at each sampled
sequence's last accepted position drafts ``d_1``; passes ``2 .. K`` are one-token decodes of the
head fed its own previous output and draft. Drafts are greedy (``verify_drafts`` relies on it).
"""
from __future__ import annotations

import dataclasses

import torch

from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.model_base import CausalLM
from armillary.sequence import Sequence


class DraftProposer:
    """``num_drafts`` draft tokens per sampled sequence from ``model.draft_forward``.

    ``caches``: the draft head's layer caches (``draft_cache_layout`` order).
    """

    def __init__(self, model: CausalLM, caches: list[LayerCache | None], num_drafts: int, block_size: int,
                 host_lists: bool) -> None:
        self.model = model
        self.caches = caches
        self.num_drafts = num_drafts
        self.block_size = block_size
        self.host_lists = host_lists  # reference kernels read the batch's host lists (CPU, reference backend)

    def fill(self, batch: ForwardBatch, hidden: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Pass 1 only (a step that samples nothing): the head's KV cache for the step's positions."""
        self.model.draft_forward(dataclasses.replace(batch, input_ids=next_ids, caches=self.caches), hidden)

    def propose(self, batch: ForwardBatch, hidden: torch.Tensor, next_ids: torch.Tensor, chunk_index: torch.Tensor,
                last_rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """batch: the step's main batch; hidden: [T, H] its final-normed output at every position;
        next_ids: [T] the token after each position; chunk_index: [S] the batch rows of the sampled
        sequences ``seqs``; last_rows: [S] the token row of each one's last accepted position
        -> [S, K] drafts."""
        first = dataclasses.replace(batch, input_ids=next_ids, caches=self.caches)
        h = self.model.draft_forward(first, hidden).index_select(0, last_rows)  # [S, H]
        drafts = [self.model.compute_logits(h).argmax(dim=-1)]
        if self.num_drafts == 1:
            return drafts[0][:, None]
        positions = batch.positions.index_select(0, last_rows)  # [S]
        tables = [self._tables(t, chunk_index) for t in (batch.group_block_tables or [batch.block_tables])]
        for step in range(1, self.num_drafts):
            one = self._decode_batch(positions + step, drafts[-1], tables, batch.max_seq_len + step)
            h = self.model.draft_forward(one, h)
            drafts.append(self.model.compute_logits(h).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    @staticmethod
    def _tables(table: torch.Tensor, chunk_index: torch.Tensor) -> torch.Tensor:
        # a zero (scratch) column after the last: look-ahead positions past the allocated blocks write there
        rows = table.index_select(0, chunk_index)
        return torch.cat([rows, torch.zeros_like(rows[:, :1])], dim=1)

    def _decode_batch(self, positions: torch.Tensor, input_ids: torch.Tensor, tables: list[torch.Tensor],
                      max_seq_len: int) -> ForwardBatch:
        num, bs, dev = positions.shape[0], self.block_size, positions.device
        cols = (positions // bs).clamp_max(tables[0].shape[1] - 1)
        slots = [t.gather(1, cols[:, None]).squeeze(1).long() * bs + positions % bs for t in tables]
        seq_lens = (positions + 1).to(torch.int32)
        qsl = torch.arange(num + 1, dtype=torch.int32, device=dev)
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, query_start_loc=qsl, context_lens=positions.to(torch.int32),
            seq_lens=seq_lens, slot_mapping=slots[0], block_tables=tables[0],
            state_slots=torch.zeros(num, dtype=torch.long, device=dev),
            logits_indices=torch.arange(num, device=dev), caches=self.caches,
            query_start_loc_cpu=None, context_lens_cpu=None, seq_lens_cpu=None, is_decode_only=True,
            max_seq_len=max_seq_len, group_block_tables=tables, group_slot_mappings=slots)
        if self.host_lists:
            batch.query_start_loc_cpu = list(range(num + 1))
            batch.seq_lens_cpu = seq_lens.tolist()
            batch.context_lens_cpu = [n - 1 for n in batch.seq_lens_cpu]
        return batch
