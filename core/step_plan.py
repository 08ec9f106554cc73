"""What one step runs (``StepPlan``, from ``Scheduler.schedule``) and what it gave back (``StepOutput``).

A plan says, per sequence, which positions the step computes and whether it samples; plus the
device-side cache operations the step performs first (zero fresh state slots, restore states)
and after its forward (snapshot states). The worker executes a plan without deciding anything;
``Scheduler.update_from_output(plan, output)`` is the only place that then moves sequences on,
so a step may accept fewer positions than it computed (speculative verification).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from armillary.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """Positions ``[start, start + num_tokens)`` of ``seq`` computed this step.

    The inputs are ``seq.token_ids[start : start + num_tokens - len(draft_tokens)]`` followed by
    ``draft_tokens`` (guesses to verify, later positions). ``sample``: the chunk reaches the end of
    the known tokens, so the step samples a token after it (after every draft position when
    drafting, K + 1 rows).
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    draft_tokens: list[int] = field(default_factory=list)
    # (position, row): the model saves the recurrent state after ``position`` (inside the chunk) to
    # snapshot ``row`` during the forward (prefix caching on a model with ``snapshots_inside_chunks``)
    snapshot: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1


@dataclass(slots=True)
class StepPlan:
    """One step: its chunks in batch order and the cache operations around its forward.

    ``input_tokens``: [len(chunks)] device ids when every chunk is one decode position whose input
    token the previous, unfinished step is still sampling (async scheduling).
    ``zero_slots``: fresh state slots, zeroed before the forward.
    ``state_copies``: (source row, destination row) state copies before the forward (restore).
    ``snapshots``: (slot, snapshot row) copies after the forward (checkpoint at a chunk end).
    ``block_copies``: (source block, destination block) page copies in every paged layer before
    the forward (a cached partial block copied before a sequence writes into it).
    """

    chunks: list[ScheduledChunk]
    input_tokens: torch.Tensor | None = None
    zero_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampled(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.sample]

    @property
    def is_decode_only(self) -> bool:
        return all(c.is_decode for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass(slots=True)
class StepOutput:
    """Host results of a step, one row per sampled chunk in plan order.

    ``token_ids[i]``: the tokens chunk ``i`` produced: one normally; with drafts, the accepted
    drafts followed by the token sampled after them. ``logprobs[i][j]`` / ``top[i][j]``: for token
    ``j`` of row ``i``, when its request asked for logprobs (else None). ``draft_tokens[i]``: with
    speculation on, the drafts proposed for row ``i``'s next step.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_ids: list[list[list[int]]] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    draft_tokens: list[list[int]] | None = None
