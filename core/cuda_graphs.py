"""Decode steps captured in CUDA graphs, one per bucketed batch size, all in one memory pool.

Graphs are captured largest batch first so smaller ones reuse the pool's memory. A step with
``B`` decodes replays the smallest bucket ``>= B``; the padding rows point at a scratch KV block
and a scratch state slot that the memory pools never hand out, so they compute garbage that
nothing reads. Models do not know they are captured: in a decode-only batch they must read only
the device tensors of the ``ForwardBatch`` (its ``*_cpu`` lists are None here, so a host-list
kernel fails at capture instead of attending to one token). A step's inputs are written on the
host into pinned buffers laid out like the static ones and copied in with three transfers
(``stage``), then the graph is replayed (``replay``). Each paged cache group has its own block
table and slot mapping rows.
"""
from __future__ import annotations

import logging

import torch

from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.kernels.triton.pdl import graph_batch
from armillary.step_plan import StepPlan

log = logging.getLogger("armillary")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class CUDAGraphDecoder:
    def __init__(self, model: torch.nn.Module, caches: list[LayerCache | None], max_batch: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, scratch_slot: int,
                 device: torch.device, num_groups: int = 1) -> None:
        self.max_seq_len = max_blocks_per_seq * block_size
        self.model = model
        self.block_size = block_size
        self.caches = caches
        self.max_batch = max_batch
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_slot
        self.buckets = graph_buckets(max_batch)
        self.num_groups = g = num_groups
        self.max_blocks = max_blocks_per_seq
        n, dev = max_batch, device
        # static inputs in two packed buffers, so a decode step stages them with two host-to-device copies:
        # rows ids, positions, state slots, then one slot-mapping row per paged group
        self.packed_i64 = torch.zeros((3 + g) * n, dtype=torch.long, device=dev)
        self.packed_i32 = torch.zeros(2 * n, dtype=torch.int32, device=dev)
        rows = self.packed_i64.view(3 + g, n)
        self.input_ids, self.positions, self.state_slots = rows[0], rows[1], rows[2]
        self.group_slot_mappings = list(rows[3:])
        self.slot_mapping = self.group_slot_mappings[0]
        self.context_lens, self.seq_lens = self.packed_i32.view(2, n)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.all_block_tables = torch.zeros(g, n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.block_tables = self.all_block_tables[0]
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        # two sets of pinned staging buffers, alternating: with async scheduling the previous step's
        # copies may still be queued behind the GPU work when the next step is staged
        self.host_buffers = [
            (torch.zeros((3 + g) * n, dtype=torch.long, pin_memory=pin),
             torch.zeros(2 * n, dtype=torch.int32, pin_memory=pin),
             torch.zeros(g * n * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin))
            for _ in range(2)
        ]
        self.num_staged = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._batches: dict[int, ForwardBatch] = {}

    def _batch(self, b: int) -> ForwardBatch:
        """The first ``b`` rows of the static buffers as a decode batch (built once per size)."""
        if b not in self._batches:
            self._batches[b] = self._new_batch(b)
        return self._batches[b]

    def _new_batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            query_start_loc=self.query_start_loc[: b + 1], context_lens=self.context_lens[:b],
            seq_lens=self.seq_lens[:b], slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            state_slots=self.state_slots[:b], logits_indices=self.logits_indices[:b], caches=self.caches,
            query_start_loc_cpu=None, context_lens_cpu=None, seq_lens_cpu=None,
            is_decode_only=True, max_seq_len=self.max_seq_len,
            group_block_tables=[t[:b] for t in self.all_block_tables],
            group_slot_mappings=[m[:b] for m in self.group_slot_mappings],
        )

    def bucket(self, num_seqs: int) -> int:
        return next(s for s in self.buckets if s >= num_seqs)

    def stage(self, plan: StepPlan) -> tuple[ForwardBatch, int]:
        """Write a decode step's inputs (one new token per chunk) straight into the static buffers:
        filled on the host, copied with two transfers plus the block-table rows, padding rows included.

        ``plan.input_tokens`` (async scheduling): device ids still being sampled by the previous
        step, copied in on the device. Returns the batch of real rows and the bucket to replay.
        """
        chunks = plan.chunks
        b, bs, g = len(chunks), self.block_size, self.num_groups
        bucket = self.bucket(b)
        host_i64, host_i32, host_tables = self.host_buffers[self.num_staged % 2]
        self.num_staged += 1
        i64, i32 = host_i64.numpy(), host_i32.numpy()
        n = self.max_batch
        width = max([len(t) for c in chunks for t in c.seq.block_tables], default=1)
        tables = host_tables[: g * b * width].view(g, b, width)
        tables_np = tables.numpy()
        for i, c in enumerate(chunks):
            seq, pos = c.seq, c.start
            i64[i] = seq.token_ids[pos] if plan.input_tokens is None else 0
            i64[n + i] = pos
            i64[2 * n + i] = seq.state_slot if seq.state_slot is not None else self.scratch_slot
            for k, table in enumerate(seq.block_tables):
                i64[(3 + k) * n + i] = table[pos // bs] * bs + pos % bs
                tables_np[k, i, : len(table)] = table
                tables_np[k, i, len(table):] = 0
            i32[i] = pos
            i32[n + i] = pos + 1
        self._host_padding(i64, i32, b, bucket)  # rows past the bucket are never read by its graph
        self.packed_i64.copy_(host_i64, non_blocking=True)
        self.packed_i32.copy_(host_i32, non_blocking=True)
        self.all_block_tables[:, :b, :width].copy_(tables, non_blocking=True)
        if plan.input_tokens is not None:
            self.input_ids[:b].copy_(plan.input_tokens)
        return self._batch(b), bucket

    def _host_padding(self, i64, i32, start: int, end: int) -> None:
        """Host rows [start, end): token 0 at position 0 in the scratch block and slot (cached length 0)."""
        n = self.max_batch
        fills = [(0, 0), (n, 0), (2 * n, self.scratch_slot)]
        fills += [((3 + k) * n, self.scratch_block * self.block_size) for k in range(self.num_groups)]
        for base, value in fills:
            i64[base + start: base + end] = value
        i32[start:end] = 0
        i32[n + start: n + end] = 1

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Stage and replay a decode plan; returns the hidden states of its real rows ``[B, H]``."""
        _, bucket = self.stage(plan)
        return self.replay(bucket, len(plan.chunks))

    def replay(self, bucket: int, num_seqs: int) -> torch.Tensor:
        """Replay a staged bucket; returns the hidden states of its real rows ``[num_seqs, H]``."""
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_seqs]

    def _reset_padding(self, start: int) -> None:
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.context_lens[start:] = 0
        self.seq_lens[start:] = 1
        self.all_block_tables[:, start:] = self.scratch_block
        for m in self.group_slot_mappings:
            m[start:] = self.scratch_block * self.block_size
        self.state_slots[start:] = self.scratch_slot

    @torch.inference_mode()
    def capture(self) -> None:
        self._reset_padding(0)
        for b in reversed(self.buckets):
            batch = self._batch(b)
            with graph_batch(b):
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

    def can_run(self, plan: StepPlan) -> bool:
        """A decode step: one new token per chunk, no drafts, at most the largest bucket of them."""
        return (bool(self.graphs) and len(plan.chunks) <= self.max_batch
                and all(c.num_tokens == 1 and not c.draft_tokens for c in plan.chunks))
