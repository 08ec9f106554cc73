"""One step with speculation on: forward, verify (or sample), draft the next step's tokens, copy to host.

A *verify step* is one whose every chunk is a decode position followed by ``K`` drafts
(``K + 1`` tokens each, the same for all, so recurrent layers can keep the state after every
position: ``ForwardBatch.spec_state_rows``). Any other step (prefill chunks, decodes without
drafts) samples as usual. Both end with the draft passes, which also keep the draft head's KV
cache filled for every position the step computed. The host learns, per sampled chunk, the
emitted tokens, how many drafts were accepted and the next drafts, in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from armillary.sampler import SamplerOutput
from armillary.speculative.proposer import DraftProposer
from armillary.speculative.verify import verify_drafts
from armillary.step_plan import StepOutput, StepPlan


@dataclass(slots=True)
class SpeculativeConfig:
    num_drafts: int
    spec_row_base: int  # state row of (slot s, position i): spec_row_base + s * num_drafts + i
    force_accept: bool = False  # benchmarks: accept every draft a sequence may accept

    def state_rows(self, slot: int) -> list[int]:
        """The rows keeping slot ``slot``'s state after verified positions 0..K-1 (``MemoryPlan.spec_row``)."""
        return [self.spec_row_base + slot * self.num_drafts + i for i in range(self.num_drafts)]


@dataclass(slots=True)
class SpecHostOutput:
    """Host copies of a speculative step, one row per sampled chunk (plan order)."""

    tokens: torch.Tensor  # [S, K+1] (a plain step: [S, 1])
    num_accepted: torch.Tensor | None  # [S]; None in a plain step
    drafts: torch.Tensor  # [S, K]
    logprobs: torch.Tensor | None  # [S, K+1]
    top_ids: torch.Tensor | None  # [S, K+1, L]
    top_logprobs: torch.Tensor | None

    def to_step_output(self) -> StepOutput:
        tokens = self.tokens.tolist()
        counts = self.num_accepted.tolist() if self.num_accepted is not None else [0] * len(tokens)
        keep = [n + 1 for n in counts]
        out = StepOutput([row[:n] for row, n in zip(tokens, keep)], draft_tokens=self.drafts.tolist())
        if self.logprobs is not None:
            out.logprobs = [row[:n] for row, n in zip(self.logprobs.tolist(), keep)]
            out.top_ids = [row[:n] for row, n in zip(self.top_ids.tolist(), keep)]
            out.top_logprobs = [row[:n] for row, n in zip(self.top_logprobs.tolist(), keep)]
        return out


def is_verify_step(plan: StepPlan, num_drafts: int) -> bool:
    return bool(plan.chunks) and all(c.sample and len(c.draft_tokens) == num_drafts and c.num_tokens == num_drafts + 1
                                     for c in plan.chunks)


def max_accepted(plan: StepPlan, num_drafts: int) -> list[int]:
    """Per chunk, how many drafts it may accept before grammars: 0 where sampling reads the tokens
    before each position on the host (a thinking budget near its end), else all of them (penalties
    and min_tokens count each row's drafts on the device)."""
    return [0 if c.seq.sampling_reads_history else num_drafts for c in plan.chunks]


def next_token_rows(plan: StepPlan) -> tuple[list[int], list[int]]:
    """A plain step's inputs of the draft pass: (the token after each position, -1 where it is the
    one the step samples; the token row of each sampled chunk's last position)."""
    ids: list[np.ndarray] = []
    last_rows: list[int] = []
    at = 0
    for c in plan.chunks:
        known = c.seq.token_ids[c.start + 1:c.end + 1]
        row = np.full(c.num_tokens, -1, dtype=np.int64)
        row[:len(known)] = known
        ids.append(row)
        at += c.num_tokens
        if c.sample:
            last_rows.append(at - 1)
    return np.concatenate(ids).tolist(), last_rows


def launch_speculative(runner, plan: StepPlan, spec: SpeculativeConfig, proposer: DraftProposer):
    """The runner's ``launch`` with speculation on; returns a ``LaunchedStep`` whose ``spec`` is set."""
    from armillary.model_runner import LaunchedStep

    k = spec.num_drafts
    verify = is_verify_step(plan, k)
    runner.cache_ops_before(plan)
    sampled = [c.seq for c in plan.chunks if c.sample]
    masks = None
    drafts_host = [c.draft_tokens for c in plan.chunks] if verify else None
    if runner.structured is not None and len(runner.structured) and sampled:
        masks = runner.structured.fill_async(sampled, drafts_host)
    graphs = runner.spec_graphs
    if verify and graphs is not None and graphs.can_run(plan):
        return _launch_graphed(runner, plan, spec, graphs, masks)
    batch = runner.prepare(plan)
    dev = batch.input_ids.device
    if verify:
        batch.spec_state_rows = torch.tensor(
            [spec.state_rows(c.seq.state_slot) if c.seq.state_slot is not None else [0] * k for c in plan.chunks],
            dtype=torch.long, device=dev)
    hidden = runner.model(batch)  # [T, H]
    runner.cache_ops_after(plan)
    if not sampled:  # a prefill chunk that does not reach the end: only the draft head's cache to fill
        next_ids, _ = next_token_rows(plan)
        proposer.fill(batch, hidden, torch.tensor(next_ids, device=dev))
        return LaunchedStep(plan, None, None, None, None)
    num = len(sampled)
    if verify:
        out, logits = _verify(runner, plan, spec, runner.model.compute_logits(hidden), masks,
                              _verify_inputs(plan, dev))
        tokens, accepted = out.tokens, out.num_accepted
        next_ids = tokens.reshape(-1)
        last_rows = torch.arange(num, device=dev) * (k + 1) + accepted
        chunk_index = torch.arange(num, device=dev)
        logprobs, top_ids, top_logprobs = out.logprobs, out.top_ids, out.top_logprobs
    else:
        next_host, last_host = next_token_rows(plan)
        last_rows = torch.tensor(last_host, dtype=torch.long, device=dev)
        logits = runner.model.compute_logits(hidden.index_select(0, last_rows))
        mask = masks.result() if masks is not None else None
        if mask is not None:
            logits = mask.apply(logits)
        sample = runner.sampler(logits, sampled)
        next_ids = torch.tensor(next_host, dtype=torch.long, device=dev).index_copy(0, last_rows, sample.token_ids)
        tokens, accepted = sample.token_ids[:, None], None
        chunk_index = torch.tensor([i for i, c in enumerate(plan.chunks) if c.sample], dtype=torch.long, device=dev)
        logprobs = sample.logprobs[:, None] if sample.logprobs is not None else None
        top_ids = sample.top_ids[:, None] if sample.top_ids is not None else None
        top_logprobs = sample.top_logprobs[:, None] if sample.top_logprobs is not None else None
    new_drafts = proposer.propose(batch, hidden, next_ids, chunk_index, last_rows, sampled)  # [S, K]
    return _launched(plan, logits, (tokens, accepted, new_drafts, logprobs, top_ids, top_logprobs))


def _to_device(rows: list, device: torch.device) -> torch.Tensor:
    """Host ints as a device tensor without waiting for the queued GPU work (pinned, asynchronous)."""
    host = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _verify_inputs(plan: StepPlan, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """[B, K] drafts on the device (enqueued before the forward), and the acceptance caps before grammars."""
    return _to_device([c.draft_tokens for c in plan.chunks], device), max_accepted(plan, len(plan.chunks[0].draft_tokens))


def _verify(runner, plan: StepPlan, spec: SpeculativeConfig, logits: torch.Tensor, masks,
            inputs: tuple[torch.Tensor, list[int]]):
    """Grammar masks (K + 1 rows per sequence), the acceptance caps, ``verify_drafts``; (output, logits)."""
    drafts, caps = inputs
    mask = masks.result() if masks is not None else None
    if mask is not None:
        logits = mask.apply(logits)
        caps = [min(c, v) for c, v in zip(caps, mask.valid_drafts)]
    caps_dev = _to_device(caps, logits.device)
    return verify_drafts(logits, plan.seqs, drafts, caps_dev, runner.sampler, spec.force_accept), logits


def _launch_graphed(runner, plan: StepPlan, spec: SpeculativeConfig, graphs, masks):
    inputs = _verify_inputs(plan, graphs.tok.device)
    hidden, logits, bucket = graphs.run_forward(plan)
    runner.cache_ops_after(plan)
    out, logits = _verify(runner, plan, spec, logits, masks, inputs)
    num = len(plan.chunks)
    last_rows = torch.arange(num, device=logits.device) * (spec.num_drafts + 1) + out.num_accepted
    drafts = graphs.run_draft(bucket, num, out.tokens.reshape(-1), last_rows)
    return _launched(plan, logits, (out.tokens, out.num_accepted, drafts, out.logprobs, out.top_ids,
                                    out.top_logprobs))


def _launched(plan: StepPlan, logits: torch.Tensor, parts: tuple):
    """The host copy of a speculative step's results, enqueued; its ``LaunchedStep``."""
    from armillary.model_runner import LaunchedStep

    device_out = SamplerOutput(parts[0][:, 0], None, None, None)
    if logits.device.type != "cuda":
        return LaunchedStep(plan, logits, device_out, None, None, spec=SpecHostOutput(*parts))
    host = SpecHostOutput(*(t.to("cpu", non_blocking=True) if t is not None else None for t in parts))
    done = torch.cuda.Event()
    done.record()
    return LaunchedStep(plan, logits, device_out, None, done, spec=host)
