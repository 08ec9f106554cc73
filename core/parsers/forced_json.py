"""Forced tool calls on a model without a tool parser: the JSON reply its grammar allows, read back as tool calls.

As vLLM serves ``tool_choice: "required"`` (and Anthropic ``any``) without a parser, the reply is a
JSON array of ``{"name": ..., "parameters": {...}}`` objects under a JSON-schema grammar; a call of
one named tool (OpenAI's named function, Anthropic's ``tool``) is that tool's bare arguments
object. Calls stream as the array does; whatever follows the JSON is content.
"""
from __future__ import annotations

import enum
from collections.abc import Callable

from armillary.parsers.base import BufferedMachine, ToolParser
from armillary.parsers.events import ParserEvent, TextDelta
from armillary.parsers.json_calls import CallStatus, JsonArgumentsReader, JsonCallReader
from armillary.parsers.json_grammar import forced_json_grammar
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

_WHITESPACE = " \t\r\n"


class _F(enum.Enum):
    START = "start"  # before the JSON: '[' (or '{' for a single named tool)
    ITEM = "item"  # inside the array, before an item or ']'
    CALL = "call"
    NEXT = "next"  # after an item: ',' or ']'
    TEXT = "text"  # after the JSON (or instead of it): content


class ForcedJsonToolParser(BufferedMachine, ToolParser):
    """Reads the array form, or with ``single`` (a tool name) the bare arguments form of ``forced_json_grammar``."""

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None,
                 single: str | None = None) -> None:
        super().__init__(tools, id_generator)
        self.single = single
        self._state = _F.START
        self._buf = ""
        self._calls = 0
        self._reader: JsonCallReader | JsonArgumentsReader | None = None

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        return forced_json_grammar(tools, constraint)

    def _allocate(self, name: str) -> tuple[int, str]:
        index = self._calls
        self._calls += 1
        return index, self.id_generator()

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        while True:
            state = self._state
            if state is _F.TEXT:
                if self._buf:
                    events.append(TextDelta(self._buf))
                    self._buf = ""
                return
            if state is _F.CALL:
                used = self._reader.feed(self._buf, events)
                self._buf = self._buf[used:]
                if self._reader.status is CallStatus.READING:
                    if not final:
                        return
                    self._reader.finish(events)
                status = self._reader.status
                if status is CallStatus.NOT_A_CALL:
                    self._buf = self._reader.raw + self._buf
                    self._state = _F.TEXT
                elif status is CallStatus.BROKEN or self.single is not None:
                    self._state = _F.TEXT
                else:
                    self._state = _F.NEXT
                continue
            head = self._buf.lstrip(_WHITESPACE)
            if not head:
                if final:
                    self._buf = ""  # whitespace around the JSON is no content
                return
            self._buf = head
            self._decide(events, state)

    def _decide(self, events: list[ParserEvent], state: _F) -> None:
        """At a structural character of the reply (``self._buf`` starts with it)."""
        char = self._buf[0]
        if state is _F.START:
            if self.single is not None and char == "{":
                index, call_id = self._allocate(self.single)
                self._reader = JsonArgumentsReader(index, call_id, self.single, events)
                self._state = _F.CALL
            elif self.single is None and char == "[":
                self._buf = self._buf[1:]
                self._state = _F.ITEM
            else:
                self._state = _F.TEXT
        elif state is _F.ITEM and char == "{":
            self._reader = JsonCallReader(self._allocate)
            self._state = _F.CALL
        elif char == "]" and (state is _F.NEXT or (state is _F.ITEM and self._calls == 0)):
            self._buf = self._buf[1:]
            self._state = _F.TEXT
        elif char == "," and state is _F.NEXT:
            self._buf = self._buf[1:]
            self._state = _F.ITEM
        else:
            self._state = _F.TEXT
