"""Builds the packed ``ForwardBatch`` of a ``StepPlan``, runs the model and samples.

The runner is the worker's step machinery: it never decides what runs, it executes the plan
(cache operations, forward through a CUDA graph or eagerly, grammar masks, sampling) and
enqueues the copy of the sampled tokens to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.memory.state_pool import StatePool
from armillary.model_base import CausalLM
from armillary.sampler import Sampler, SamplerOutput
from armillary.speculative.proposer import DraftProposer
from armillary.speculative.step import SpecHostOutput, SpeculativeConfig, launch_speculative
from armillary.step_plan import StepOutput, StepPlan
from armillary.structured.outputs import StructuredOutputs


@dataclass(slots=True)
class LaunchedStep:
    """A plan whose GPU work is enqueued: the device logits and sampler output, and the host copy
    of that output, readable after ``wait``."""

    plan: StepPlan
    logits: torch.Tensor | None
    output: SamplerOutput | None
    host: SamplerOutput | None
    done: torch.cuda.Event | None  # recorded after the host copy; None on the CPU
    spec: SpecHostOutput | None = None  # speculation on: emitted tokens, accepted counts, next drafts

    def wait(self) -> StepOutput | None:
        """The sampled tokens (and logprobs) on the host, once the step has run; None if none sampled."""
        if self.done is not None:
            self.done.synchronize()
        if self.spec is not None:
            return self.spec.to_step_output()
        h = self.host
        if h is None:
            return None
        tokens = [[t] for t in h.token_ids.tolist()]
        if h.logprobs is None:
            return StepOutput(tokens)
        return StepOutput(tokens, [[x] for x in h.logprobs.tolist()], [[x] for x in h.top_ids.tolist()],
                          [[x] for x in h.top_logprobs.tolist()])


class ModelRunner:
    def __init__(self, model: CausalLM, caches: list[LayerCache | None], block_size: int,
                 device: torch.device, sampler: Sampler | None = None, graphs: CUDAGraphDecoder | None = None,
                 structured: StructuredOutputs | None = None, states: StatePool | None = None,
                 num_groups: int = 1, speculative: SpeculativeConfig | None = None,
                 proposer: DraftProposer | None = None) -> None:
        self.model = model
        self.structured = structured  # grammar matchers; None: no sequence is ever constrained
        self.graphs = graphs
        self.caches = caches
        self.states = states
        self.block_size = block_size
        self.num_groups = num_groups  # paged cache groups (one block table each)
        self.device = device
        self.sampler = sampler or Sampler()
        self.speculative = speculative  # with ``proposer``: every step drafts the next one's tokens
        self.proposer = proposer
        self.spec_graphs = None  # SpecGraphs: verify steps in CUDA graphs

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Flatten the plan's chunks into one packed batch (``plan.input_tokens`` fill the ids)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in range(self.num_groups)]
        qsl = [0]
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        for c in plan.chunks:
            seq = c.seq
            if plan.input_tokens is None:
                input_ids.extend(seq.token_ids[c.start:c.end - len(c.draft_tokens)])
                input_ids.extend(c.draft_tokens)
            else:
                input_ids.append(0)
            pos = np.arange(c.start, c.end)  # [n]; numpy: a 16K-token chunk costs no per-token Python
            positions.append(pos)
            for g in range(self.num_groups):
                table = np.asarray(seq.block_tables[g], dtype=np.int64) if seq.block_tables else np.zeros(1, np.int64)
                slots[g].append(table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + c.num_tokens)
            ctx_lens.append(c.start)
            seq_lens.append(c.end)
            if c.sample:  # the rows whose logits are sampled: the last, or every draft position too
                first = qsl[-1] - 1 - len(c.draft_tokens)
                logits_idx.extend(range(first, qsl[-1]))
        dev = self.device

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        def cat(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(dev)

        tables = []
        for g in range(self.num_groups):
            rows = [c.seq.block_tables[g] if c.seq.block_tables else [] for c in plan.chunks]
            width = max(1, max(len(r) for r in rows))
            tables.append(t([r + [0] * (width - len(r)) for r in rows], torch.int32))
        slot_maps = [cat(s) for s in slots]
        batch = ForwardBatch(
            input_ids=t(input_ids, torch.long),
            positions=cat(positions),
            query_start_loc=t(qsl, torch.int32),
            context_lens=t(ctx_lens, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            slot_mapping=slot_maps[0],
            block_tables=tables[0],
            state_slots=t([c.seq.state_slot if c.seq.state_slot is not None else 0 for c in plan.chunks], torch.long),
            logits_indices=t(logits_idx, torch.long),
            caches=self.caches,
            query_start_loc_cpu=qsl,
            context_lens_cpu=ctx_lens,
            seq_lens_cpu=seq_lens,
            is_decode_only=plan.is_decode_only,
            max_seq_len=max(seq_lens),
            group_block_tables=tables,
            group_slot_mappings=slot_maps,
            state_snapshots=[(i, c.snapshot[0] - c.start, c.snapshot[1]) for i, c in enumerate(plan.chunks)
                             if c.snapshot is not None],
        )
        if plan.input_tokens is not None:
            batch.input_ids.copy_(plan.input_tokens)
        return batch

    def cache_ops_before(self, plan: StepPlan) -> None:
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        if self.states is None:
            return
        self.states.zero(plan.zero_slots)
        if plan.state_copies:
            self.states.copy([s for s, _ in plan.state_copies], [d for _, d in plan.state_copies])

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        seen: set[int] = set()  # subgroups share storage tensors: copy each once
        for cache in self.caches:
            for page in (getattr(cache, "k", None), getattr(cache, "v", None), getattr(cache, "kv", None)):
                if page is not None and page.data_ptr() not in seen:
                    seen.add(page.data_ptr())
                    if page.element_size() == 1:  # fp8 pages: index_copy_ has no fp8 kernel on the CPU
                        page = page.view(torch.uint8)
                    page.index_copy_(0, dst, page.index_select(0, src))

    def cache_ops_after(self, plan: StepPlan) -> None:
        if self.states is not None and plan.snapshots:
            self.states.copy([s for s, _ in plan.snapshots], [d for _, d in plan.snapshots])

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Enqueue the plan's cache operations, forward and sampling, and the copy of the sampled
        tokens to the host; ``LaunchedStep.wait`` returns them."""
        if self.proposer is not None:
            return launch_speculative(self, plan, self.speculative, self.proposer)
        self.cache_ops_before(plan)
        sampled = [c.seq for c in plan.chunks if c.sample]
        graphed = self.graphs is not None and self.graphs.can_run(plan)
        masks = None
        if self.structured is not None and len(self.structured) and sampled:
            masks = self.structured.fill_async(sampled)  # grammar work on a worker thread, during the forward
        if graphed:
            hidden = self.graphs.run(plan)
            if len(sampled) < len(plan.chunks):  # single-token prefill chunks that do not reach the end
                hidden = hidden[[i for i, c in enumerate(plan.chunks) if c.sample]]
        else:
            batch = self.prepare(plan)
            hidden = self.model(batch)
            if sampled:
                hidden = hidden.index_select(0, batch.logits_indices)  # cheaper than advanced indexing on the CPU
        self.cache_ops_after(plan)
        if not sampled:
            return LaunchedStep(plan, None, None, None, None)
        logits = self.model.compute_logits(hidden)
        mask = masks.result() if masks is not None else None
        if mask is not None:
            logits = mask.apply(logits)  # in place: the returned logits are the masked ones
        out = self.sampler(logits, sampled, pending=plan.input_tokens)  # async: penalties count the awaited token
        if self.device.type != "cuda":
            return LaunchedStep(plan, logits, out, out, None)
        host = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None
                               for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(plan, logits, out, host, done)
