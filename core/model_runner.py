"""Builds the packed ``ForwardBatch`` for a step, runs the model and samples."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.model_base import CausalLM
from armillary.sampler import Sampler, SamplerOutput
from armillary.sequence import Sequence
from armillary.structured.outputs import StructuredOutputs


@dataclass(slots=True)
class LaunchedStep:
    """A step whose GPU work is enqueued: its sequences, those sampled (in row order), the device
    logits and sampler output, and the host copy of that output, readable after ``wait``."""

    seqs: list[Sequence]
    sampled: list[Sequence]
    logits: torch.Tensor | None
    output: SamplerOutput | None
    host: SamplerOutput | None
    done: torch.cuda.Event | None  # recorded after the host copy; None on the CPU

    def wait(self) -> SamplerOutput | None:
        """The sampled tokens (and logprobs) on the host, once the step has run."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


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

    def prepare(self, seqs: list[Sequence], input_tokens: torch.Tensor | None = None
                ) -> tuple[ForwardBatch, list[Sequence]]:
        """Flatten the scheduled chunks; returns the batch and the sequences that get a token.

        ``input_tokens``: as in ``launch`` (every sequence then feeds exactly its one pending token).
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        qsl = [0]
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        sampled: list[Sequence] = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end] if input_tokens is None else [0])
            pos = np.arange(start, end)  # [n]; numpy: a 16K-token chunk costs no per-token Python
            positions.append(pos)
            slots.append(np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            ctx_lens.append(start)
            seq_lens.append(end)
            if end == len(seq) or input_tokens is not None:  # the chunk reaches the last token: sample the next
                logits_idx.append(qsl[-1] - 1)
                sampled.append(seq)
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        dev = self.device

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        def cat(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(dev)

        batch = ForwardBatch(
            input_ids=t(input_ids, torch.long),
            positions=cat(positions),
            query_start_loc=t(qsl, torch.int32),
            context_lens=t(ctx_lens, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            slot_mapping=cat(slots),
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
        if input_tokens is not None:
            batch.input_ids.copy_(input_tokens)
        return batch, sampled

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None, SamplerOutput | None]:
        """Forward the step; returns (sequences sampled, their logits [N, V], sampler output)."""
        step = self.launch(seqs)
        return step.sampled, step.logits, step.output

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], input_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Enqueue the step's forward and sampling, and the copy of the sampled tokens to the host.

        ``input_tokens``: [len(seqs)] device ids when each sequence feeds one token still being sampled
        by the previous, unfinished step (async scheduling); the host lists do not hold them yet.
        """
        graphed = self.graphs is not None and self.graphs.can_run(seqs)
        if graphed:
            batch, bucket = self.graphs.stage(seqs, input_tokens)
            sampled = seqs if input_tokens is not None else [s for s in seqs if s.num_computed_tokens + 1 == len(s)]
        else:
            batch, sampled = self.prepare(seqs, input_tokens)
        masks = None
        if self.structured is not None and len(self.structured) and sampled:
            masks = self.structured.fill_async(sampled)  # grammar work on a worker thread, during the forward
        if graphed:
            hidden = self.graphs.replay(bucket, len(seqs))
            if len(sampled) < len(seqs):  # single-token prefill chunks that do not reach the end sample nothing
                hidden = hidden[[i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == len(s)]]
        else:
            hidden = self.model(batch)
        if not sampled:
            return LaunchedStep(seqs, sampled, None, None, None, None)
        if not graphed:
            hidden = hidden[batch.logits_indices]
        logits = self.model.compute_logits(hidden)
        mask = masks.result() if masks is not None else None
        if mask is not None:
            logits = mask.apply(logits)  # in place: the returned logits are the masked ones
        out = self.sampler(logits, sampled)
        if self.device.type != "cuda":
            return LaunchedStep(seqs, sampled, logits, out, out, None)
        host = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None
                               for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(seqs, sampled, logits, out, host, done)
