"""Per-sequence grammar matchers of one engine: created on add, brought up to date per step, freed on finish.

A matcher mirrors its sequence's output tokens. It is brought in line when the next mask is
filled, all sequences of the step in one batch call: the token sampled last step is accepted, a
sequence whose tokens were cut back (rejected speculative tokens) rolls its matcher back, and one
that gained several tokens replays them; preemption by recompute keeps the tokens, and so the
matcher, as they are. That work runs on a worker thread while the device runs the step's forward
(``fill_async``).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from armillary.sequence import Sequence
from armillary.structured.bitmask import TokenBitmask
from armillary.structured.compiler import GrammarCompiler
from armillary.structured.spec import StructuredSpec

log = logging.getLogger("armillary")


@dataclass(slots=True)
class _Matched:
    matcher: Any  # xgrammar GrammarMatcher
    num_accepted: int  # output tokens the matcher has consumed
    failed: bool = False  # a token the grammar forbids was appended (only if masking was bypassed)


class StructuredOutputs:
    """The engine's grammar side: a compile cache plus one matcher per constrained sequence.

    ``fill_threads``: threads xgrammar uses to fill the masks of a batch (default: half the cores, up to 8).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 fill_threads: int | None = None) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        # half the cores, as xgrammar's own default: the rest keep running torch's threads
        self.fill_threads = fill_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._matched: dict[int, _Matched] = {}  # seq_id -> its matcher
        self._batch_filler = None
        self._worker: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._matched)

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar (cached); ``InvalidRequestError`` for a bad constraint."""
        return self.compiler.compile(spec)

    def attach(self, seq: Sequence, compiled: Any) -> None:
        import xgrammar as xgr

        self._matched[seq.seq_id] = _Matched(xgr.GrammarMatcher(compiled), 0)

    def release(self, seq: Sequence) -> None:
        self._matched.pop(seq.seq_id, None)

    def advance(self, seq: Sequence, token: int) -> bool:
        """The token just appended to ``seq``: True when the grammar ends the sequence.

        Masking lets a stop token through only once the grammar is complete, so taking one ends
        the sequence (even under ``ignore_eos``: nothing may follow). A sequence whose earlier
        token broke its grammar (which masking rules out; logged as the bug it would be) ends too.
        The matcher itself consumes the token with the batch, at the next fill.
        """
        state = self._matched.get(seq.seq_id)
        if state is None:
            return False
        return state.failed or token in self.stop_token_ids

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (the caller removes them from ``seq``)."""
        state = self._matched.get(seq.seq_id)
        if state is not None and num_tokens > 0:
            state.matcher.rollback(num_tokens)
            state.num_accepted -= num_tokens

    def fill_async(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> Future:
        """``fill(seqs, drafts)`` on a worker thread; nothing else may touch these sequences until it is done."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="armillary-grammar")
        return self._worker.submit(self.fill, seqs, drafts)

    def fill(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> TokenBitmask | None:
        """The next-token masks of the constrained ``seqs`` (a row per sequence); None if none is constrained.

        With ``drafts`` (K per sequence, a verify step), K + 1 rows per sequence: row ``i`` allows
        what may follow the first ``i`` drafts; ``valid_drafts`` says how many drafts the grammar takes.
        """
        import xgrammar as xgr

        constrained = [row for row, seq in enumerate(seqs) if seq.seq_id in self._matched]
        states = [self._matched[seqs[row].seq_id] for row in constrained]
        self._sync_all([seqs[row] for row in constrained], states)
        if drafts is not None:
            return self._fill_drafts(seqs, drafts, constrained, states)
        rows = [row for row, state in zip(constrained, states) if not state.failed]
        matchers = [state.matcher for state in states if not state.failed]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # [B, W]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            if self._batch_filler is None:
                self._batch_filler = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch_filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        guard = self.compiler.utf8_guard
        for row in rows:
            guard.restrict(bitmask[row], seqs[row].output_token_ids)
        return TokenBitmask(bitmask, rows)

    def _fill_drafts(self, seqs: list[Sequence], drafts: list[list[int]], constrained: list[int],
                     states: list[_Matched]) -> TokenBitmask | None:
        """K + 1 mask rows per sequence: each constrained matcher walks its drafts, then rolls back."""
        import xgrammar as xgr

        width = len(drafts[0]) + 1 if drafts else 1
        valid = [width - 1] * len(seqs)
        bitmask = xgr.allocate_token_bitmask(len(seqs) * width, self.vocab_size)  # [B(K+1), W]
        rows: list[int] = []
        guard = self.compiler.utf8_guard
        for b, state in zip(constrained, states):
            if state.failed:
                continue
            taken = 0
            for i in range(width):
                if i and state.matcher.is_terminated():
                    break  # a draft ended the grammar: the sequence stops there, later rows are dropped
                row = b * width + i
                state.matcher.fill_next_token_bitmask(bitmask, row)
                guard.restrict(bitmask[row], seqs[b].output_token_ids + drafts[b][:i])
                rows.append(row)
                if i == width - 1 or not state.matcher.accept_token(drafts[b][i]):
                    break
                taken += 1
            valid[b] = taken
            if taken:
                state.matcher.rollback(taken)
        if not rows:
            return None
        return TokenBitmask(bitmask, rows, valid)

    def _sync_all(self, seqs: list[Sequence], states: list[_Matched]) -> None:
        """Bring each matcher to its sequence's output; the usual one new token each goes in one batch call."""
        import xgrammar as xgr

        one_behind: list[tuple[Sequence, _Matched]] = []
        for seq, state in zip(seqs, states):
            if not state.failed and state.num_accepted == seq.num_output_tokens - 1:
                one_behind.append((seq, state))
            elif not state.failed:
                self._sync(seq, state, upto=seq.num_output_tokens)
        if not one_behind:
            return
        tokens = [seq.token_ids[-1] for seq, _ in one_behind]
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for _, s in one_behind], tokens)
        for (seq, state), token, ok in zip(one_behind, tokens, accepted):
            if ok:
                state.num_accepted += 1
            else:
                log.error("request %s: token %d breaks its grammar; ending the sequence", seq.request_id, token)
                state.failed = True

    def _sync(self, seq: Sequence, state: _Matched, upto: int) -> None:
        """Make the matcher have consumed exactly the first ``upto`` output tokens of ``seq``."""
        if state.num_accepted > upto:
            state.matcher.rollback(state.num_accepted - upto)
            state.num_accepted = upto
        if state.num_accepted < upto:
            for token in seq.output_token_ids[state.num_accepted:upto]:
                if not state.matcher.accept_token(token):
                    log.error("request %s: token %d breaks its grammar; ending the sequence", seq.request_id, token)
                    state.failed = True
                    return
                state.num_accepted += 1
