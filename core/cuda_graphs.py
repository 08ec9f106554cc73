"""Decode steps captured in CUDA graphs, one per bucketed batch size, all in one memory pool.

Graphs are captured largest batch first so smaller ones reuse the pool's memory. A step with
``B`` decodes replays the smallest bucket ``>= B``; the padding rows point at a scratch KV block
and a scratch state slot that the memory pools never hand out, so they compute garbage that
nothing reads. Models do not know they are captured: in a decode-only batch they must read only
the device tensors of the ``ForwardBatch`` (its ``*_cpu`` lists are placeholders here).
"""
from __future__ import annotations

import logging

import torch

from armillary.forward_batch import ForwardBatch, LayerCache

log = logging.getLogger("armillary")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class CUDAGraphDecoder:
    def __init__(self, model: torch.nn.Module, caches: list[LayerCache | None], max_batch: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, scratch_slot: int,
                 device: torch.device) -> None:
        self.max_seq_len = max_blocks_per_seq * block_size
        self.model = model
        self.block_size = block_size
        self.caches = caches
        self.max_batch = max_batch
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_slot
        self.buckets = graph_buckets(max_batch)
        n, dev = max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            query_start_loc=self.query_start_loc[: b + 1], context_lens=self.context_lens[:b],
            seq_lens=self.seq_lens[:b], slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            state_slots=self.state_slots[:b], logits_indices=self.logits_indices[:b], caches=self.caches,
            query_start_loc_cpu=list(range(b + 1)), context_lens_cpu=[0] * b, seq_lens_cpu=[1] * b,
            is_decode_only=True, max_seq_len=self.max_seq_len,
        )

    def _reset_padding(self, start: int) -> None:
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.context_lens[start:] = 0
        self.seq_lens[start:] = 1
        self.block_tables[start:] = self.scratch_block
        self.slot_mapping[start:] = self.scratch_block * self.block_size
        self.state_slots[start:] = self.scratch_slot

    @torch.inference_mode()
    def capture(self) -> None:
        self._reset_padding(0)
        for b in reversed(self.buckets):
            batch = self._batch(b)
            self.model(batch)  # warm-up: triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode_only and batch.num_seqs <= self.max_batch and bool(self.graphs)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the bucket for ``batch`` (decodes only); returns hidden states ``[B, H]``."""
        b = batch.num_seqs
        bucket = next(s for s in self.buckets if s >= b)
        self.input_ids[:b] = batch.input_ids
        self.positions[:b] = batch.positions
        self.context_lens[:b] = batch.context_lens
        self.seq_lens[:b] = batch.seq_lens
        self.slot_mapping[:b] = batch.slot_mapping
        width = batch.block_tables.shape[1]
        self.block_tables[:b, :width] = batch.block_tables
        self.state_slots[:b] = batch.state_slots
        if bucket > b:
            self._reset_padding(b)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
