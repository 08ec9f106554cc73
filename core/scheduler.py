"""Continuous batching: which sequences run this step and how many of their tokens.

One token budget per step is shared by decodes (1 token each) and prefill chunks. Running
sequences go first, oldest first; waiting ones are admitted while the budget, the sequence cap,
free state slots and free KV blocks allow. When blocks run out, the newest running sequence is
preempted by recompute: everything it holds is freed and it waits at the front of the queue.
"""
from __future__ import annotations

from collections import deque

from armillary.memory.block_manager import BlockManager
from armillary.memory.state_pool import StatePool
from armillary.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 blocks: BlockManager, states: StatePool | None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = blocks
        self.states = states  # None for models without recurrent layers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences; each gets ``num_new_tokens`` and the blocks to hold them."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_hold(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self._take(seq, n, scheduled)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.can_hold(seq, n) or (self.states is not None and self.states.num_free == 0):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.states is not None:
                seq.state_slot = self.states.allocate()
            self.running.append(seq)
            self._take(seq, n, scheduled)
            budget -= n
        return scheduled

    def schedule_continuation(self, seqs: list[Sequence]) -> bool:
        """Async scheduling: one more decode token for each of ``seqs``, whose last token the step in
        flight is still sampling. False (nothing changed) when the blocks for it are not free."""
        if len(seqs) > self.max_num_batched_tokens:
            return False
        missing = sum(self.blocks.num_missing(s, s.num_computed_tokens + 1) for s in seqs)
        if missing > self.blocks.num_free:
            return False  # the synchronous schedule preempts as it must
        for seq in seqs:
            self._take(seq, 1, [])
        return True

    def _take(self, seq: Sequence, n: int, scheduled: list[Sequence]) -> None:
        self.blocks.grow(seq, seq.num_computed_tokens + n)
        seq.num_new_tokens = n
        scheduled.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.state_slot is not None and self.states is not None:
            self.states.free(seq.state_slot)
        seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.num_new_tokens = 0

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
