"""Verify steps in CUDA graphs: per bucketed batch size, one graph for the main forward over
``B × (K+1)`` tokens (hidden states and logits) and one for the draft passes.

Verification runs eagerly between the two (grammar masks, sampling, a few small kernels); it
writes the draft passes' inputs (the token after each position, each sequence's last accepted
row) into static buffers the second graph reads. Padding rows of a bucket point at the scratch
block and the scratch slot (whose speculation rows exist too), as in ``CUDAGraphDecoder``.
Every verify chunk has the same length, so ``query_start_loc`` and the batch's host
``query_start_loc_cpu`` are static per bucket; the other host lists are None (kernels that need
them fail at capture).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from armillary.cuda_graphs import graph_buckets
from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.kernels.triton.pdl import graph_batch
from armillary.speculative.step import SpeculativeConfig
from armillary.step_plan import StepPlan

log = logging.getLogger("armillary")


class SpecGraphs:
    def __init__(self, model: torch.nn.Module, proposer, caches: list[LayerCache | None], max_batch: int,
                 spec: SpeculativeConfig, max_blocks_per_seq: int, block_size: int, scratch_slot: int,
                 device: torch.device, num_groups: int = 1) -> None:
        self.model, self.proposer, self.caches = model, proposer, caches
        self.k, self.width = spec.num_drafts, spec.num_drafts + 1
        self.max_batch, self.block_size, self.num_groups = max_batch, block_size, num_groups
        self.max_blocks = max_blocks_per_seq + 1  # + a scratch column: draft look-ahead past the last block
        self.max_seq_len = max_blocks_per_seq * block_size
        self.scratch_slot, self.spec = scratch_slot, spec
        self.buckets = graph_buckets(max_batch)
        n, t, g, dev = max_batch, max_batch * self.width, num_groups, device
        # token rows: ids, positions, next ids (draft input), one slot-mapping row per group
        self.tok = torch.zeros(3 + g, t, dtype=torch.long, device=dev)
        # sequence rows: state slot, last accepted row, spec rows (K)
        self.seq = torch.zeros(2 + self.k, n, dtype=torch.long, device=dev)
        self.lens = torch.zeros(2, n, dtype=torch.int32, device=dev)  # context_lens, seq_lens
        self.tables = torch.zeros(g, n, self.max_blocks, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, (n + 1) * self.width, self.width, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # hidden, logits, drafts
        self.pool = None
        self._inputs: dict[int, tuple] = {}

    def _batch(self, b: int) -> ForwardBatch:
        t = b * self.width
        return ForwardBatch(
            input_ids=self.tok[0, :t], positions=self.tok[1, :t], query_start_loc=self.qsl[: b + 1],
            context_lens=self.lens[0, :b], seq_lens=self.lens[1, :b], slot_mapping=self.tok[3, :t],
            block_tables=self.tables[0, :b], state_slots=self.seq[0, :b],
            logits_indices=torch.arange(t, device=self.tok.device), caches=self.caches,
            query_start_loc_cpu=list(range(0, (b + 1) * self.width, self.width)), context_lens_cpu=None,
            seq_lens_cpu=None, is_decode_only=False, max_seq_len=self.max_seq_len,
            group_block_tables=[self.tables[i, :b] for i in range(self.num_groups)],
            group_slot_mappings=[self.tok[3 + i, :t] for i in range(self.num_groups)],
            spec_state_rows=self.seq[2:, :b].t())

    def bucket(self, num_seqs: int) -> int:
        return next(s for s in self.buckets if s >= num_seqs)

    def can_run(self, plan: StepPlan) -> bool:
        return bool(self.graphs) and len(plan.chunks) <= self.max_batch and all(
            len(t) < self.max_blocks for c in plan.chunks for t in c.seq.block_tables)

    @torch.inference_mode()
    def capture(self) -> None:
        self._pad(0, self.max_batch)
        for b in reversed(self.buckets):
            batch = self._batch(b)
            chunk_index = torch.arange(b, device=self.tok.device)
            with graph_batch(b):
                for _ in range(2):  # warm-up outside the capture: Triton compiles, autotunes
                    hidden = self.model(batch)
                    self.model.compute_logits(hidden)
                    self.proposer.propose(batch, hidden, self.tok[2, : b * self.width], chunk_index, self.seq[1, :b],
                                          [])
                self._pad(0, self.max_batch)
                torch.cuda.synchronize()
                forward, draft = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(forward, pool=self.pool):
                    hidden = self.model(batch)
                    logits = self.model.compute_logits(hidden)
                if self.pool is None:
                    self.pool = forward.pool()
                with torch.cuda.graph(draft, pool=self.pool):
                    drafts = self.proposer.propose(batch, hidden, self.tok[2, : b * self.width], chunk_index,
                                                   self.seq[1, :b], [])
            self.graphs[b] = (forward, draft)
            self.outputs[b] = (hidden, logits, drafts)
            self._inputs[b] = (batch, chunk_index)  # tensors made outside the capture: the graphs read them
        torch.cuda.synchronize()
        log.info("captured speculative verify CUDA graphs (K=%d) for batch sizes %s", self.k, self.buckets)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end): position 0.. of an empty sequence in the scratch block and slot."""
        w = self.width
        self.tok[:, start * w:end * w] = 0
        self.tok[1, start * w:end * w] = torch.arange(w, device=self.tok.device).repeat(end - start)
        self.seq[0, start:end] = self.scratch_slot
        self.seq[1, start:end] = torch.arange(start, end, device=self.tok.device) * w
        for i, row in enumerate(self.spec.state_rows(self.scratch_slot)):
            self.seq[2 + i, start:end] = row
        self.lens[0, start:end] = 0
        self.lens[1, start:end] = w
        self.tables[:, start:end] = 0

    def run_forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Stage a verify plan and replay its bucket's forward: (hidden [T, H], logits [T, V], bucket)."""
        chunks, w, bs, k = plan.chunks, self.width, self.block_size, self.k
        b = len(chunks)
        bucket = self.bucket(b)
        tok = np.zeros((3 + self.num_groups, b * w), dtype=np.int64)
        seq = np.zeros((2 + k, b), dtype=np.int64)
        lens = np.zeros((2, b), dtype=np.int32)
        width = max(len(t) for c in chunks for t in c.seq.block_tables)
        tables = np.zeros((self.num_groups, b, width), dtype=np.int32)
        for i, c in enumerate(chunks):
            s, p = c.seq, c.start
            pos = np.arange(p, p + w)
            tok[0, i * w] = s.token_ids[p]
            tok[0, i * w + 1:(i + 1) * w] = c.draft_tokens
            tok[1, i * w:(i + 1) * w] = pos
            for g, table in enumerate(s.block_tables):
                row = np.asarray(table, dtype=np.int64)
                tok[3 + g, i * w:(i + 1) * w] = row[pos // bs] * bs + pos % bs
                tables[g, i, :len(table)] = table
            seq[0, i] = s.state_slot
            seq[2:, i] = self.spec.state_rows(s.state_slot)
            lens[:, i] = (p, p + w)
        dev = self.tok.device
        self.tok[:, : b * w].copy_(torch.from_numpy(tok).pin_memory(), non_blocking=True)
        self.seq[:, :b].copy_(torch.from_numpy(seq).pin_memory(), non_blocking=True)
        self.lens[:, :b].copy_(torch.from_numpy(lens).pin_memory(), non_blocking=True)
        self.tables[:, :b].zero_()
        self.tables[:, :b, :width].copy_(torch.from_numpy(tables).pin_memory().to(dev, non_blocking=True))
        if bucket > b:
            self._pad(b, bucket)
        forward, _ = self.graphs[bucket]
        forward.replay()
        hidden, logits, _ = self.outputs[bucket]
        return hidden[: b * w], logits[: b * w], bucket

    def run_draft(self, bucket: int, num: int, next_ids: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        """Replay the draft passes after verification wrote their inputs: [num, K] drafts."""
        w = self.width
        self.tok[2, : num * w].copy_(next_ids)
        self.seq[1, :num].copy_(last_rows)
        _, draft = self.graphs[bucket]
        draft.replay()
        return self.outputs[bucket][2][:num]
