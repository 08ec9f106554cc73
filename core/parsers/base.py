"""Parser contracts: streaming reasoning and tool-call state machines, and the pipeline joining them.

A parser is a state machine fed with text deltas (any chunking: tokens, characters, the whole
output at once); for the same total text it produces events that reduce to the same message.
Text that might be the start of a markup string is held back until it is decided and released
as text when it turns out not to be markup. ``finish()`` flushes what is still held.
"""
from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from armillary.parsers.events import (
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """``call_`` followed by 24 random letters and digits (OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class BufferedMachine(ABC):
    """A parser that keeps undecided text in ``self._buf`` and moves on in ``_advance(events, final)``.

    ``feed`` appends a delta and advances; ``finish`` advances in final mode, then ``_flush``
    handles whatever final mode left (default: nothing). Put it first among a parser's bases.
    """

    _buf: str

    def feed(self, delta: str) -> list[ParserEvent]:
        self._buf += delta
        events: list[ParserEvent] = []
        self._advance(events, final=False)
        return events

    def finish(self) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        self._advance(events, final=True)
        self._flush(events)
        return events

    @abstractmethod
    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        """Emit every event the buffer now decides; in final mode decide everything possible."""

    def _flush(self, events: list[ParserEvent]) -> None:
        return None


class ReasoningParser(ABC):
    """Splits model output into reasoning and content.

    ``thinking_open``: the chat template already opened the reasoning block in the prompt (Qwen3
    with ``enable_thinking``), so the output starts inside reasoning. Emits only ``ReasoningDelta``
    and ``TextDelta``.
    """

    # Strings the parser must see verbatim in its input: the server must not drop them when it
    # detokenizes (e.g. as special tokens), or the parser cannot find them.
    markup_strings: ClassVar[tuple[str, ...]] = ()
    # The text that closes a reasoning block. Structured output (a JSON schema, forced tool calls)
    # constrains what follows it; None: the reply cannot be constrained while reasoning is open.
    end_tag: ClassVar[str | None] = None

    def __init__(self, thinking_open: bool) -> None:
        self.thinking_open = thinking_open

    @classmethod
    @abstractmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt leaves the reasoning block open (the value for ``thinking_open``)."""

    @abstractmethod
    def feed(self, delta: str) -> list[ParserEvent]:
        """Consume the next piece of output text; return the events it decides."""

    @abstractmethod
    def finish(self) -> list[ParserEvent]:
        """The output ended: return the events for everything still held back."""


class ToolParser(ABC):
    """Turns content text into ``TextDelta`` and tool-call events.

    ``tools``: the request's tools in OpenAI function form
    ``{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}``,
    used to type the arguments; None or a missing tool means untyped arguments.
    ``id_generator``: makes tool call ids (default ``new_tool_call_id``; injectable for tests).
    """

    markup_strings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        self.tools = list(tools or [])
        self.id_generator = id_generator or new_tool_call_id
        self.parameter_schemas: dict[str, dict] = {}  # tool name -> its parameters JSON schema
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                params = function.get("parameters")
                self.parameter_schemas[function["name"]] = params if isinstance(params, dict) else {}

    @abstractmethod
    def feed(self, delta: str) -> list[ParserEvent]:
        """Consume the next piece of content text; return the events it decides."""

    @abstractmethod
    def finish(self) -> list[ParserEvent]:
        """The output ended: flush held text and close or give up an unterminated call."""

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec | None:
        """The grammar of this format's tool calls under ``constraint`` (forced or strict calls).

        Everything it allows must parse back, through this parser, into calls whose arguments
        satisfy their tool's schema. ``tools``: the request's tools in OpenAI function form.
        Raises ``InvalidRequestError`` for a tool the format cannot express. None (the default):
        this format has no grammar, so forced and strict tool calls cannot be served with it.
        """
        return None


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass(slots=True)
class ParsedMessage:
    """A whole response reduced from events: what a non-streaming reply carries."""

    content: str
    reasoning: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def reduce_events(events: Iterable[ParserEvent]) -> ParsedMessage:
    """Fold an event stream into one message (content and reasoning concatenated, calls in order)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, ParsedToolCall] = {}
    for event in events:
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = ParsedToolCall(event.id, event.name, "")
        elif isinstance(event, ToolCallArgsDelta):
            calls[event.index].arguments += event.delta
        elif isinstance(event, ToolCallEnd):
            calls[event.index].arguments = event.arguments
    return ParsedMessage(
        content="".join(content),
        reasoning="".join(reasoning) if reasoning else None,
        tool_calls=[calls[i] for i in sorted(calls)],
    )


class ParserPipeline:
    """Reasoning first, then tool calls on the content: tool calls inside reasoning stay reasoning."""

    def __init__(self, reasoning: ReasoningParser | None, tool: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tool = tool

    @property
    def markup_strings(self) -> tuple[str, ...]:
        """Every string either parser needs to see verbatim in the detokenized output."""
        found: list[str] = []
        for parser in (self.reasoning, self.tool):
            if parser is not None:
                found.extend(s for s in parser.markup_strings if s not in found)
        return tuple(found)

    def feed(self, delta: str) -> list[ParserEvent]:
        if self.reasoning is not None:
            staged = self.reasoning.feed(delta)
        else:
            staged = [TextDelta(delta)] if delta else []
        return self._route_text(staged)

    def finish(self) -> list[ParserEvent]:
        staged = self.reasoning.finish() if self.reasoning is not None else []
        events = self._route_text(staged)
        if self.tool is not None:
            events.extend(self.tool.finish())
        return events

    def parse_complete(self, text: str) -> ParsedMessage:
        """Non-streaming use: the whole output at once through the same state machines."""
        return reduce_events(self.feed(text) + self.finish())

    def _route_text(self, staged: list[ParserEvent]) -> list[ParserEvent]:
        if self.tool is None:
            return staged
        events: list[ParserEvent] = []
        for event in staged:
            if isinstance(event, TextDelta):
                events.extend(self.tool.feed(event.text))
            else:
                events.append(event)
        return events
