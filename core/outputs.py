"""What the engine hands back each step, cumulative per request (as vLLM's ``RequestOutput``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top-k alternatives (log_softmax of raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative, stop string cut, special tokens skipped per params
    token_ids: list[int]  # cumulative output ids
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (not recomputed)
