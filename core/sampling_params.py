"""Per-request sampling settings, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field

from armillary.errors import InvalidRequestError
from armillary.structured.spec import StructuredSpec

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None  # grammar the output must follow (JSON schema, regex, tool calls, ...)
    thinking_budget: int | None = None  # reasoning tokens before the end of thinking is forced (thinking_budget.py)
    thinking_end: str | None = None  # the marker forced then; None: the model's reasoning parser's end tag
    extra: dict = field(default_factory=dict)  # front-end specific fields, ignored by the engine

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int) or self.thinking_budget < 0):
            bad(f"thinking_budget must be a non-negative integer, got {self.thinking_budget!r}")
        if self.logprobs is not None and self.logprobs < 0:  # the server caps it (--max-logprobs)
            bad(f"logprobs must be 0 or more, got {self.logprobs}")
        if self.structured is not None and self.min_tokens > 0:
            # a complete grammar allows only end-of-sequence, which min_tokens would forbid
            bad("min_tokens cannot be combined with structured output")
