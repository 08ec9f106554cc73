"""One generation stream: its tokens, its progress through the cache, its blocks and state slot."""
from __future__ import annotations

import enum
import itertools

import torch

from armillary.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_counter = itertools.count()


class Sequence:
    """``token_ids`` = prompt + output; ``num_computed_tokens`` of them are in the cache.

    Only ``Scheduler.update_from_output`` advances ``num_computed_tokens``; ``num_scheduled_tokens``
    is where the steps in flight will have brought it (ahead of it while an async step runs).
    ``block_tables[g]`` lists the blocks of paged cache group ``g``; ``state_slot`` is the recurrent
    group's slot. A sequence is preempted by recompute: everything it holds is freed and both
    counts return to 0, keeping its tokens, so it re-prefills them later.
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None, arrival: float = 0.0,
                 max_tokens: int | None = None) -> None:
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.status = SequenceStatus.WAITING
        self.block_tables: list[list[int]] = []  # per paged cache group; [] until first allocated
        self.state_slot: int | None = None
        self.chunk_stops: list[int] = []  # ascending positions a prefill chunk must end at (snapshots)
        self.snapshots: dict[int, int] = {}  # position -> snapshot row holding the state there
        self.num_cached_tokens: int | None = None  # prompt positions its first admission found cached
        self.draft_tokens: list[int] = []  # speculation: the tokens proposed to follow, verified next step
        # speculation: after a partly accepted verify step the state lives in this row until the
        # next step copies it into the slot (``state_row`` is where it is now)
        self.pending_state_row: int | None = None
        self.eos_token_ids = eos_token_ids
        self.thinking = None  # a ThinkingBudget (thinking_budget.py) when the request limits its reasoning
        self.arrival = arrival
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens  # output cap
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed)
        # per output token: (logprob of the sampled token, [(token_id, logprob), ...] top-k)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        return len(self.token_ids) - self.num_scheduled_tokens

    @property
    def block_table(self) -> list[int]:
        """The first paged group's blocks (the only group of most models)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def state_row(self) -> int | None:
        """The state row holding this sequence's recurrent state right now."""
        return self.pending_state_row if self.pending_state_row is not None else self.state_slot

    @property
    def sampling_reads_history(self) -> bool:
        """Whether the next tokens' sampling needs the tokens before them on the host: a thinking budget
        near its end (async continuation and draft acceptance must wait). Penalties and ``min_tokens``
        do not: the sampler counts the token still on the device and each verify row's drafts."""
        return self.thinking is not None and self.thinking.reads_history(self.token_ids, self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
