"""Thinking budgets: after N reasoning tokens a sequence is made to write the end-of-thinking marker next.

A request's ``SamplingParams.thinking_budget`` is N. It applies when the prompt leaves a
reasoning block open (the chat template wrote ``<think>``), so every output token before the
marker is reasoning. Once N of them are out and the model has not closed the block itself, the
sampler forces the marker's tokens one step at a time (``force_thinking_end``), like a one-shot
grammar; the model then writes its answer. The marker is the reasoning parser's end tag
(``</think>``): the model's default parser, or the one a front end names in
``SamplingParams.thinking_end``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from armillary.errors import InvalidRequestError

# a verify step may accept up to this many drafts: that close to the budget, sampling reads the history
_MAX_DRAFTS = 3


class ThinkingBudget:
    """One sequence's budget: ``budget`` reasoning tokens, then ``marker`` (token ids) forced.

    ``reasoning_ended(token_ids, start)`` follows the output incrementally (tokens cut back by
    rejected drafts are forgotten); ``forced_token`` is the marker token the next position must be.
    """

    __slots__ = ("budget", "marker", "_scanned", "_end")

    def __init__(self, budget: int, marker: tuple[int, ...]) -> None:
        self.budget = budget
        self.marker = marker
        self._scanned = 0  # output positions already searched for the marker
        self._end: int | None = None  # output length at which the marker was complete

    def reasoning_ended(self, token_ids: list[int], start: int) -> bool:
        """Whether the output (``token_ids[start:]``) holds the whole marker."""
        n = len(token_ids) - start
        if self._end is not None and self._end > n:  # tokens were cut back past the marker
            self._end = None
        self._scanned = min(self._scanned, n)
        if self._end is None and self._scanned < n:
            m = len(self.marker)
            first = max(0, self._scanned - m + 1)  # a marker may straddle the last scan's end
            for at in range(first, n - m + 1):
                at_ids = token_ids[start + at:start + at + m]
                if at_ids[0] == self.marker[0] and tuple(at_ids) == self.marker:
                    self._end = at + m
                    break
            self._scanned = n
        return self._end is not None

    def forced_token(self, token_ids: list[int], start: int) -> int | None:
        """The marker token the next output position must hold, or None (under budget, or reasoning ended)."""
        n = len(token_ids) - start
        if n < self.budget or self.reasoning_ended(token_ids, start):
            return None
        # the marker written so far: forced tokens, or the model's own start of it at the budget
        tail = token_ids[start + max(self.budget, n - len(self.marker) + 1):]
        for k in range(min(len(tail), len(self.marker) - 1), 0, -1):
            if tuple(tail[-k:]) == self.marker[:k]:
                return self.marker[k]
        return self.marker[0]

    def reads_history(self, token_ids: list[int], start: int) -> bool:
        """Whether the next positions may be forced: near the budget with reasoning still open, the
        sampler needs the tokens on the host (no async continuation, no drafts accepted)."""
        n = len(token_ids) - start
        return n + _MAX_DRAFTS + 1 >= self.budget and not self.reasoning_ended(token_ids, start)


@dataclass(frozen=True, slots=True)
class ThinkingRule:
    """A request's budget and marker; ``start()`` gives each of its sequences its own state."""

    budget: int
    marker: tuple[int, ...]

    def start(self) -> ThinkingBudget:
        return ThinkingBudget(self.budget, self.marker)


class ThinkingBudgets:
    """An engine's side of thinking budgets: which requests get one, and their marker's token ids."""

    def __init__(self, registry: Any, arch: Any, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parser_cls = None  # the model's default reasoning parser, loaded on first use
        self._parser_name = getattr(arch, "default_reasoning_parser", None)
        self._registry = registry
        self._markers: dict[str, tuple[int, ...]] = {}

    def rule(self, params: Any, prompt: str | None, prompt_ids: list[int]) -> ThinkingRule | None:
        """The request's rule, or None: no budget, or its prompt leaves no reasoning block open.

        With ``params.thinking_end`` the caller has checked that the prompt opens reasoning;
        otherwise the model's default reasoning parser decides and gives the end tag.
        Raises ``InvalidRequestError`` when there is no marker to force.
        """
        if params.thinking_budget is None:
            return None
        end = params.thinking_end
        if end is None:
            parser = self._default_parser()
            if parser is None or not getattr(parser, "end_tag", None):
                raise InvalidRequestError("thinking_budget needs a reasoning parser with an end tag; this model's "
                                          "architecture names none")
            if self.tokenizer is None:
                raise InvalidRequestError("thinking_budget needs the model's tokenizer, and this model has none")
            text = prompt if prompt is not None else self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
            if not parser.prompt_opens_reasoning(text):
                return None  # thinking off (or the model opens it itself): nothing is budgeted
            end = parser.end_tag
        return ThinkingRule(params.thinking_budget, self._marker(end))

    def _default_parser(self):
        if self.parser_cls is None and self._parser_name and self._parser_name in self._registry.parsers:
            self.parser_cls = self._registry.parsers.get(self._parser_name).load()
        return self.parser_cls

    def _marker(self, end: str) -> tuple[int, ...]:
        marker = self._markers.get(end)
        if marker is None:
            if self.tokenizer is None:
                raise InvalidRequestError("thinking_budget needs the model's tokenizer, and this model has none")
            marker = tuple(self.tokenizer.encode(end, add_special_tokens=False))
            if not marker:
                raise InvalidRequestError(f"the end-of-thinking marker {end!r} encodes to no tokens")
            self._markers[end] = marker
        return marker


def force_thinking_end(logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
    """logits: [B, V]; rows whose sequence must write a marker token now allow only it (a new tensor if any)."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        budget = seq.thinking
        if budget is None:
            continue
        token = budget.forced_token(seq.token_ids, seq.num_prompt_tokens)
        if token is not None and 0 <= token < vocab:
            rows.append(i)
            cols.append(token)
    if not rows:
        return logits
    from armillary.sampler import _to_device

    r = _to_device(rows, torch.int64, logits.device)
    c = _to_device(cols, torch.int64, logits.device)
    forced = logits.index_fill(0, r, float("-inf"))
    # 0, not the token's own logit: a grammar may have masked it, and it must still be the one chosen
    return forced.index_put((r, c), torch.zeros(len(rows), dtype=logits.dtype, device=logits.device))
