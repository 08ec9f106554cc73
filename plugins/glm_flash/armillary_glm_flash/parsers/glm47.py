"""Streaming parser for GLM-4.5 / 4.6 / 4.7 tool calls (``--tool-call-parser glm47``).

GLM-4.7's chat template writes each call as::

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value><arg_key>K2</arg_key>...</tool_call>

(GLM-4.5 / 4.6 put newlines between the tags; whitespace between tags is ignored.) A string
argument is its raw text, any other the JSON of its value; the tool's JSON schema says which.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import ClassVar

from armillary.parsers.base import BufferedMachine, ToolParser
from armillary.parsers.events import ParserEvent, TextDelta
from armillary.parsers.scan import find_first_tag, partial_tag_len
from armillary.parsers.xml_args import XmlArguments
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary_glm_flash.parsers.glm47_grammar import glm47_call_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
_NAME_END = (KEY_OPEN, CALL_CLOSE)


class _State(enum.Enum):
    TEXT = "text"  # content, looking for <tool_call>
    NAME = "name"  # after <tool_call>, the function name up to <arg_key> or </tool_call>
    BODY = "body"  # between arguments
    KEY = "key"  # after <arg_key>
    BETWEEN = "between"  # after </arg_key>, expecting <arg_value>
    VALUE = "value"  # after <arg_value>, up to </arg_value>


def _bad_name(text: str) -> bool:
    """A name never holds markup or a line break (surrounding whitespace aside)."""
    return any(c in text for c in "<>") or "\n" in text.strip()


class Glm47ToolParser(BufferedMachine, ToolParser):
    """glm47 tool calls as ``ToolCallStart`` / ``ToolCallArgsDelta`` / ``ToolCallEnd`` events.

    Arguments are one JSON object written with ``json.dumps`` separators and ``ensure_ascii=False``;
    the deltas of a call concatenate to exactly its ``ToolCallEnd.arguments``. ``ToolCallStart``
    (with ``{``) goes out once the name is complete; a string-typed value streams as it arrives,
    any other goes out whole at ``</arg_value>``; ``}`` and ``ToolCallEnd`` at ``</tool_call>``.
    Values are verbatim; the literal ``null`` is JSON null; the rest follows ``convert_argument``
    (a tool or argument the schema does not know is untyped: JSON if it parses, else the text).

    Content before, between and after calls is kept verbatim except whitespace right after a call.
    A ``<tool_call>`` whose name is empty or malformed is released as text, markup included. A
    started call is always closed: at ``finish()`` a cut-off value keeps the text that arrived, an
    argument without a value is dropped, and the call ends with what it has.
    """

    markup_strings: ClassVar[tuple[str, ...]] = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._state = _State.TEXT
        self._buf = ""
        self._calls = 0
        self._skip_ws = False  # just after a call: whitespace is dropped
        self._arguments = XmlArguments()  # the open call's arguments and value
        self._key = ""  # the open value's key ("" : the value is skipped)
        self._scan_from = 0

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        return glm47_call_grammar(tools, constraint)

    def _flush(self, events: list[ParserEvent]) -> None:
        if self._state is not _State.TEXT:  # final mode leaves a started call open: close it
            self._close_call(events)
            self._state = _State.TEXT

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        handlers = {_State.TEXT: self._on_text, _State.NAME: self._on_name, _State.BODY: self._on_body,
                    _State.KEY: self._on_key, _State.BETWEEN: self._on_between, _State.VALUE: self._on_value}
        while handlers[self._state](events, final):
            pass

    def _on_text(self, events: list[ParserEvent], final: bool) -> bool:
        buf = self._buf
        pos = buf.find(CALL_OPEN)
        if pos >= 0:
            self._emit_text(events, buf[:pos])
            self._buf = buf[pos + len(CALL_OPEN):]
            self._state = _State.NAME
            return True
        cut = len(buf) if final else len(buf) - partial_tag_len(buf, (CALL_OPEN,))
        self._emit_text(events, buf[:cut])
        self._buf = buf[cut:]
        return False

    def _on_name(self, events: list[ParserEvent], final: bool) -> bool:
        buf = self._buf
        hit = find_first_tag(buf, _NAME_END)
        head = buf[:hit[0]] if hit is not None else buf[:len(buf) - (0 if final else partial_tag_len(buf, _NAME_END))]
        if _bad_name(head) or (hit is None and final) or (hit is not None and not head.strip()):
            self._emit_text(events, CALL_OPEN)  # not a call after all: the markup is content
            self._state = _State.TEXT
            return True
        if hit is None:
            return False
        self._start_call(events, head.strip())
        self._buf = buf[hit[0] + len(hit[1]):]
        if hit[1] == KEY_OPEN:
            self._state = _State.KEY
        else:
            self._end_call(events)
        return True

    def _on_body(self, events: list[ParserEvent], final: bool) -> bool:
        tag = self._skip_to_tag((KEY_OPEN, CALL_CLOSE, CALL_OPEN), final)
        if tag is None:
            return False
        if tag == KEY_OPEN:
            self._state = _State.KEY
        elif tag == CALL_CLOSE:
            self._end_call(events)
        else:  # a new call before this one was closed
            self._close_call(events)
            self._state = _State.NAME
        return True

    def _on_key(self, events: list[ParserEvent], final: bool) -> bool:
        hit = find_first_tag(self._buf, (KEY_CLOSE, VALUE_OPEN, CALL_CLOSE))
        if hit is None:
            if final:
                self._buf = ""
            return False
        pos, tag = hit
        key = self._buf[:pos].strip()
        self._buf = self._buf[pos + len(tag):]
        if tag == CALL_CLOSE:  # a key without a value: dropped
            self._end_call(events)
        elif not key:
            self._state = _State.BODY if tag == KEY_CLOSE else _State.VALUE
            self._key = ""
        elif tag == KEY_CLOSE:
            self._key = key
            self._state = _State.BETWEEN
        else:  # <arg_value> without </arg_key>
            self._begin_value(key)
        return True

    def _on_between(self, events: list[ParserEvent], final: bool) -> bool:
        tag = self._skip_to_tag((VALUE_OPEN, KEY_OPEN, CALL_CLOSE), final)
        if tag is None:
            return False
        if tag == VALUE_OPEN:
            self._begin_value(self._key)
        elif tag == KEY_OPEN:  # the previous key had no value: dropped
            self._state = _State.KEY
        else:
            self._end_call(events)
        return True

    def _on_value(self, events: list[ParserEvent], final: bool) -> bool:
        buf = self._buf
        pos = buf.find(VALUE_CLOSE, self._scan_from)
        if pos >= 0 or final:
            end = pos if pos >= 0 else len(buf) - partial_tag_len(buf, (VALUE_CLOSE,))
            if self._key:
                self._arguments.finish_value(events, buf[:end])
                self._key = ""
            self._buf = buf[pos + len(VALUE_CLOSE):] if pos >= 0 else ""
            self._state = _State.BODY
            return True
        if self._arguments.streams and self._key:
            cut = len(buf) - partial_tag_len(buf, (VALUE_CLOSE,))
            self._arguments.stream(events, buf[:cut])
            self._buf = buf[cut:]
        else:
            self._scan_from = max(0, len(buf) - len(VALUE_CLOSE) + 1)
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _skip_to_tag(self, tags: tuple[str, ...], final: bool) -> str | None:
        """Drop text up to and including the first of ``tags``; None (holding a partial tag) if none."""
        hit = find_first_tag(self._buf, tags)
        if hit is None:
            keep = 0 if final else partial_tag_len(self._buf, tags)
            self._buf = self._buf[len(self._buf) - keep:]
            return None
        self._buf = self._buf[hit[0] + len(hit[1]):]
        return hit[1]

    def _emit_text(self, events: list[ParserEvent], text: str) -> None:
        if self._skip_ws:
            text = text.lstrip()
            self._skip_ws = not text
        if text:
            events.append(TextDelta(text))

    def _start_call(self, events: list[ParserEvent], name: str) -> None:
        index = self._calls
        self._calls += 1
        self._arguments.start_call(events, index, self.id_generator(), name, self.parameter_schemas.get(name))

    def _close_call(self, events: list[ParserEvent]) -> None:
        self._arguments.close_call(events)

    def _end_call(self, events: list[ParserEvent]) -> None:
        self._close_call(events)
        self._skip_ws = True
        self._state = _State.TEXT

    def _begin_value(self, key: str) -> None:
        self._key = key
        self._arguments.begin_value(key)
        self._scan_from = 0
        self._state = _State.VALUE
