"""Protocol-neutral events that parsers emit; server/ renders them as OpenAI or Anthropic deltas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(slots=True, frozen=True)
class TextDelta:
    """Visible assistant content (never empty, never markup of a recognised call or think block)."""

    text: str


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    """Reasoning ("thinking") text, without the tags that delimit it."""

    text: str


@dataclass(slots=True, frozen=True)
class ToolCallStart:
    """A tool call begins; ``index`` counts calls of one response from 0."""

    index: int
    id: str
    name: str


@dataclass(slots=True, frozen=True)
class ToolCallArgsDelta:
    """The next piece of the call's JSON arguments (the pieces concatenate to valid JSON)."""

    index: int
    delta: str


@dataclass(slots=True, frozen=True)
class ToolCallEnd:
    """The call is complete; ``arguments`` equals the concatenation of all its argument deltas."""

    index: int
    arguments: str


ParserEvent = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
