"""Continuous batching: which sequences run each step, and the one place their progress is recorded.

One token budget per step is shared by decodes (1 token each) and prefill chunks. Running
sequences go first, oldest first; waiting ones are admitted while the budget, the sequence cap
and the cache coordinator allow. When memory runs out, the newest running sequence is preempted
by recompute: everything it holds is freed and it waits at the front of the queue. A prefill
chunk ends early at a position listed in ``seq.chunk_stops`` (block-aligned checkpoints), where
the step snapshots the recurrent state when the snapshot budget allows.

``schedule()`` returns a ``StepPlan``; after the worker ran it, ``update_from_output(plan,
output)`` advances ``num_computed_tokens``, trims what was not accepted, returns blocks that
left a sliding window, appends the sampled tokens and finishes sequences.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from armillary.memory.coordinator import CacheCoordinator
from armillary.sequence import Sequence, SequenceStatus
from armillary.step_plan import ScheduledChunk, StepOutput, StepPlan

# called for each token appended to a sequence; returns a finish reason ("stop", "length") or None
TokenCheck = Callable[[Sequence, int], "str | None"]


def _length_only(seq: Sequence, token: int) -> str | None:
    return "length" if seq.num_output_tokens >= seq.max_tokens else None


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, cache: CacheCoordinator,
                 check_token: TokenCheck = _length_only) -> None:
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
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        snapshots: list[tuple[int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_len(seq, budget)
            while not self.cache.allocate(seq, seq.num_scheduled_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            chunks.append(self._chunk(seq, n, snapshots))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk_len(seq, budget)
            if not self.cache.allocate(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n, snapshots))
            budget -= n
        return StepPlan(chunks, zero_slots=self.cache.take_fresh_slots(), snapshots=snapshots)

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
        return StepPlan(chunks, input_tokens=input_tokens)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        start = seq.num_scheduled_tokens
        n = min(seq.num_unscheduled_tokens, budget)
        for stop in seq.chunk_stops:
            if start < stop < start + n:
                return stop - start
        return n

    def _chunk(self, seq: Sequence, n: int, snapshots: list[tuple[int, int]]) -> ScheduledChunk:
        start = seq.num_scheduled_tokens
        seq.num_scheduled_tokens = start + n
        end = start + n
        rec = self.cache.recurrent
        if end in seq.chunk_stops and rec is not None and end not in seq.snapshots:
            row = rec.new_snapshot()
            if row is not None:
                snapshots.append((seq.state_slot, row))
                seq.snapshots[end] = row
        return ScheduledChunk(seq, start, n, sample=end == len(seq))

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
