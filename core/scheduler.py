"""Continuous batching: which sequences run each step, and the one place their progress is recorded.

One token budget per step is shared by decodes (1 token each) and prefill chunks. Running
sequences go first, oldest first; waiting ones are admitted while the budget, the sequence cap
and the cache coordinator allow. The scheduling policy (``scheduling_policy.py``: fcfs, slai)
sets the step's budget, what of it prefill chunks may take, and the order of admission. When
memory runs out, the newest running sequence is preempted by recompute: everything it holds is
freed and it waits at the front of the queue. A prefill chunk ends early at the deepest position
in ``seq.chunk_stops`` (block-aligned checkpoints) it reaches, where the step snapshots the
recurrent state when the snapshot budget allows; a model with ``snapshots_inside_chunks`` saves
that state itself part-way through the chunk, which then runs on to its budget.

``schedule()`` returns a ``StepPlan``; after the worker ran it, ``update_from_output(plan,
output)`` advances ``num_computed_tokens``, trims what was not accepted, returns blocks that
left a sliding window, appends the sampled tokens and finishes sequences.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from armillary.memory.coordinator import CacheCoordinator
from armillary.scheduling_policy import SchedulingPolicy, StepBudget
from armillary.sequence import Sequence, SequenceStatus
from armillary.step_plan import ScheduledChunk, StepOutput, StepPlan

# called for each token appended to a sequence; returns a finish reason ("stop", "length") or None
TokenCheck = Callable[[Sequence, int], "str | None"]


def _length_only(seq: Sequence, token: int) -> str | None:
    return "length" if seq.num_output_tokens >= seq.max_tokens else None


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, cache: CacheCoordinator,
                 check_token: TokenCheck = _length_only, num_drafts: int = 0,
                 spec_row: Callable[[int, int], int] | None = None, policy: SchedulingPolicy | None = None,
                 snapshots_inside_chunks: bool = False) -> None:
        self.policy = policy or SchedulingPolicy()  # admission order and step budget (fcfs unless given)
        self.snapshots_inside_chunks = snapshots_inside_chunks  # the model saves states mid-chunk itself
        self.num_drafts = num_drafts  # speculation: drafts verified per decode step (0: off)
        self.spec_row = spec_row  # (slot, position i) -> the row holding the state after verified position i
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache = cache
        self.check_token = check_token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning

    def schedule(self) -> StepPlan:
        """Pick this step's chunks; each sequence gets the cache it needs for them (or is preempted)."""
        verify = self._is_verify_step()
        limit = self.max_num_batched_tokens
        room = max(0, self.max_num_seqs - len(self.running))  # sequences that may be admitted
        # verify steps are all decodes of K + 1 positions: the whole budget, no admissions
        step = StepBudget(limit, limit) if verify else self.policy.budget(self.running, self.waiting, limit, room)
        budget, prefill = step.tokens, step.prefill
        chunks: list[ScheduledChunk] = []
        snapshots: list[tuple[int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefilling = not verify and seq.num_unscheduled_tokens > 1
            cap = min(budget, prefill - step.reserved) if prefilling else budget
            if cap <= 0:
                i += 1
                continue  # the policy keeps this step's prefill tokens for others
            n = self.num_drafts + 1 if verify else self._chunk_len(seq, cap)
            while not self.cache.allocate(seq, seq.num_scheduled_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            chunks.append(self._verify_chunk(seq) if verify else self._chunk(seq, n, snapshots))
            budget -= n
            prefill -= n if prefilling else 0
            i += 1
        for seq in [] if preempted or verify else self.policy.admission_order(self.waiting, room):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._sibling_prefilling(seq):
                break  # n > 1: the request's first sequence computes the prompt, the others then hit it
            self.cache.match_prefix(seq)  # resumes at the deepest cached prefix (prefix caching)
            prefilling = seq.num_unscheduled_tokens > 1
            cap = min(budget, prefill) if prefilling else budget
            n = self._chunk_len(seq, cap) if cap > 0 else 0
            if not n or not self.cache.allocate(seq, seq.num_scheduled_tokens + n):
                self.cache.unmatch(seq)
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n, snapshots))
            budget -= n
            prefill -= n if prefilling else 0
        copies = []
        for chunk in chunks:  # states a partly accepted verify step left outside their slot
            if chunk.seq.pending_state_row is not None:
                copies.append((chunk.seq.pending_state_row, chunk.seq.state_slot))
                chunk.seq.pending_state_row = None
        zero = self.cache.take_fresh_slots()
        prefix_states, block_copies = self.cache.take_copies()
        return StepPlan(chunks, zero_slots=zero, state_copies=prefix_states + copies, snapshots=snapshots,
                        block_copies=block_copies)

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """Prefix caching: a later sample of a request waits while an earlier one computes the prompt."""
        if self.cache.prefix is None or seq.index == 0 or seq.num_preemptions:
            return False
        return any(s.request_id == seq.request_id and s.num_computed_tokens < s.num_prompt_tokens - 1
                   for s in self.running)

    def _is_verify_step(self) -> bool:
        """Speculation: every running sequence decodes with a full set of drafts, and nobody waits
        who could be admitted now (a step is all verify chunks or none, so shapes stay uniform)."""
        k = self.num_drafts
        if not k or not self.running or len(self.running) * (k + 1) > self.max_num_batched_tokens:
            return False
        if self.waiting and len(self.running) < self.max_num_seqs:
            return False
        return all(s.num_unscheduled_tokens == 1 and len(s.draft_tokens) == k for s in self.running)

    def _verify_chunk(self, seq: Sequence) -> ScheduledChunk:
        start = seq.num_scheduled_tokens
        seq.num_scheduled_tokens = start + 1 + self.num_drafts
        return ScheduledChunk(seq, start, 1 + self.num_drafts, sample=True, draft_tokens=list(seq.draft_tokens))

    def schedule_continuation(self, seqs: list[Sequence], input_tokens: torch.Tensor) -> StepPlan | None:
        """Async scheduling: one more decode position for each of ``seqs``, whose input token the
        step in flight is still sampling (``input_tokens``, on the device). None (nothing changed)
        when the budget or the free blocks do not allow it: the next synchronous step then decides."""
        if len(seqs) > self.max_num_batched_tokens:
            return None
        need = sum(self.cache.blocks_needed(s, s.num_scheduled_tokens + 1) for s in seqs)
        if need > self.cache.pool.num_free:
            return None
        chunks = []
        for seq in seqs:
            self.cache.allocate(seq, seq.num_scheduled_tokens + 1)
            chunks.append(ScheduledChunk(seq, seq.num_scheduled_tokens, 1, sample=True))
            seq.num_scheduled_tokens += 1
        state_copies, block_copies = self.cache.take_copies()  # ended sequences' states (prefix caching)
        return StepPlan(chunks, input_tokens=input_tokens, state_copies=state_copies, block_copies=block_copies)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        start = seq.num_scheduled_tokens
        n = min(seq.num_unscheduled_tokens, budget)
        stops = seq.chunk_stops
        while stops and stops[0] <= start:
            stops.pop(0)  # passed: a long decode must not rescan its prompt's checkpoints every step
        if self.snapshots_inside_chunks:
            return n  # the model saves the state at the checkpoint inside the chunk (``_chunk``)
        inside = [stop for stop in stops if stop <= start + n] if stops and stops[0] <= start + n else []
        return inside[-1] - start if inside else n  # the deepest checkpoint: one snapshot per chunk at most

    def _chunk(self, seq: Sequence, n: int, snapshots: list[tuple[int, int]]) -> ScheduledChunk:
        start = seq.num_scheduled_tokens
        seq.num_scheduled_tokens = start + n
        end = start + n
        rec = self.cache.recurrent
        # the deepest checkpoint the chunk reaches: one snapshot per chunk at most
        stop = max((p for p in seq.chunk_stops if start < p <= end), default=None) if rec is not None else None
        if stop is None or stop in seq.snapshots:
            return ScheduledChunk(seq, start, n, sample=end == len(seq))
        row = rec.new_snapshot()
        if row is None:
            return ScheduledChunk(seq, start, n, sample=end == len(seq))
        seq.snapshots[stop] = row
        if stop == end:  # the chunk ends there: copied from the slot after the forward
            snapshots.append((seq.state_slot, row))
            return ScheduledChunk(seq, start, n, sample=end == len(seq))
        return ScheduledChunk(seq, start, n, sample=end == len(seq), snapshot=(stop, row))

    # ---- results

    def update_from_output(self, plan: StepPlan, output: StepOutput | None) -> list[Sequence]:
        """Record what ``plan`` computed and sampled; returns the sequences that got tokens.

        A chunk with drafts computed ``num_tokens`` positions but keeps only the real ones and
        the accepted drafts (``len(tokens) - 1`` of them): the rest is trimmed as if never run.
        Sequences that finished or were aborted meanwhile are skipped.
        """
        touched: list[Sequence] = []
        row = -1  # the output row of the latest sampled chunk
        for chunk in plan.chunks:
            row += chunk.sample
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            tokens = output.token_ids[row] if chunk.sample and output is not None else []
            accepted = max(0, len(tokens) - 1) if chunk.draft_tokens else 0
            computed = chunk.end - len(chunk.draft_tokens) + accepted
            seq.num_computed_tokens = computed
            if computed < chunk.end:
                seq.num_scheduled_tokens = computed
                self.cache.trim(seq, computed)
            if chunk.draft_tokens and accepted < len(chunk.draft_tokens) and seq.state_slot is not None \
                    and self.spec_row is not None and self.cache.recurrent is not None:
                seq.pending_state_row = self.spec_row(seq.state_slot, accepted)
            if chunk.sample:
                seq.draft_tokens = output.draft_tokens[row] if output is not None and output.draft_tokens else []
            self.cache.cache_computed(seq)  # prefix caching: register what is computed now
            self.cache.release_stale(seq)
            for j, token in enumerate(tokens):
                k = seq.params.logprobs
                if k is not None and output.logprobs is not None:
                    top = list(zip(output.top_ids[row][j][:k], output.top_logprobs[row][j][:k])) if k else []
                    seq.logprobs.append((output.logprobs[row][j], top))
                seq.token_ids.append(token)
                reason = self.check_token(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            if tokens:
                touched.append(seq)
        return touched

    # ---- freeing

    def _release(self, seq: Sequence) -> None:
        self.cache.free(seq)
        rec = self.cache.recurrent
        for snapshot in seq.snapshots.values():
            rec.free_snapshot(snapshot)
        seq.snapshots.clear()
        seq.draft_tokens = []
        seq.pending_state_row = None
        seq.num_computed_tokens = 0
        seq.num_scheduled_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (stop, length or abort) and free everything it holds, wherever it is."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
