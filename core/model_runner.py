"""Builds the packed ``ForwardBatch`` for a step, runs the model and samples."""
from __future__ import annotations

import torch

from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.model_base import CausalLM
from armillary.sampler import Sampler, SamplerOutput
from armillary.sequence import Sequence
from armillary.structured.outputs import StructuredOutputs


class ModelRunner:
    def __init__(self, model: CausalLM, caches: list[LayerCache | None], block_size: int,
                 device: torch.device, sampler: Sampler | None = None, graphs: CUDAGraphDecoder | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        self.model = model
        self.structured = structured  # grammar matchers; None: no sequence is ever constrained
        self.graphs = graphs
        self.caches = caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()

    def prepare(self, seqs: list[Sequence]) -> tuple[ForwardBatch, list[Sequence]]:
        """Flatten the scheduled chunks; returns the batch and the sequences that get a token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        sampled: list[Sequence] = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            ctx_lens.append(start)
            seq_lens.append(end)
            if end == len(seq):  # the chunk reaches the last known token: sample the next one
                logits_idx.append(qsl[-1] - 1)
                sampled.append(seq)
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        dev = self.device

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = ForwardBatch(
            input_ids=t(input_ids, torch.long),
            positions=t(positions, torch.long),
            query_start_loc=t(qsl, torch.int32),
            context_lens=t(ctx_lens, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            slot_mapping=t(slots, torch.long),
            block_tables=t(tables, torch.int32),
            state_slots=t([s.state_slot if s.state_slot is not None else 0 for s in seqs], torch.long),
            logits_indices=t(logits_idx, torch.long),
            caches=self.caches,
            query_start_loc_cpu=qsl,
            context_lens_cpu=ctx_lens,
            seq_lens_cpu=seq_lens,
            is_decode_only=all(s.num_new_tokens == 1 for s in seqs),
            max_seq_len=max(seq_lens),
        )
        return batch, sampled

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None, SamplerOutput | None]:
        """Forward the step; returns (sequences sampled, their logits [N, V], sampler output)."""
        batch, sampled = self.prepare(seqs)
        masks = None
        if self.structured is not None and len(self.structured) and sampled:
            masks = self.structured.fill_async(sampled)  # grammar work on a worker thread, during the forward
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model(batch)
        if not sampled:
            return sampled, None, None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        mask = masks.result() if masks is not None else None
        if mask is not None:
            logits = mask.apply(logits)  # in place: the returned logits are the masked ones
        return sampled, logits, self.sampler(logits, sampled)
