"""JSON tool-call parsers for templates without a native format: ``hermes`` and ``llama3_json``.

- ``hermes`` (Hermes 2 Pro, Qwen2.5, many fine-tunes)::

      text <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call> text

  one object per ``<tool_call>`` block, several blocks per reply, content around them.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the reply *is* the calls, optionally
  after ``<|python_tag|>``::

      {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

  A reply that does not open with a call object is content, all of it.

Both accept ``arguments`` or ``parameters``; arguments stream as the model writes them (see
``json_calls``). Whitespace right after a call is dropped from the content.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import ClassVar

from armillary.parsers.base import BufferedMachine, ToolParser
from armillary.parsers.events import ParserEvent, TextDelta
from armillary.parsers.json_calls import CallStatus, JsonCallReader
from armillary.parsers.json_grammar import hermes_call_grammar, llama3_json_call_grammar
from armillary.parsers.scan import find_first_tag, partial_tag_len
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"


class _JsonToolParser(BufferedMachine, ToolParser):
    """What both formats share: call numbering, content emission, the call reader."""

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._buf = ""
        self._raw = ""  # markup taken since the call began, given back as text if it is no call
        self._calls = 0
        self._skip_ws = False  # just after a call: whitespace is dropped
        self._reader: JsonCallReader | None = None

    def _allocate(self, name: str) -> tuple[int, str]:
        index = self._calls
        self._calls += 1
        return index, self.id_generator()

    def _emit_text(self, events: list[ParserEvent], text: str) -> None:
        if self._skip_ws:
            text = text.lstrip(_WHITESPACE)
            self._skip_ws = not text
        if text:
            events.append(TextDelta(text))

    def _read_call(self, events: list[ParserEvent], final: bool) -> CallStatus:
        """Feed the open call; its status (READING: everything buffered was consumed)."""
        reader = self._reader
        used = reader.feed(self._buf, events)
        self._buf = self._buf[used:]
        if reader.status is CallStatus.READING and final:
            reader.finish(events)
        if reader.status is CallStatus.NOT_A_CALL:
            self._buf = self._raw + reader.raw + self._buf
            self._raw = ""
        return reader.status

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        raise NotImplementedError


class _H(enum.Enum):
    TEXT = "text"
    OPEN = "open"  # after <tool_call>: whitespace, then the call's '{'
    CALL = "call"
    TAIL = "tail"  # after the call object: up to </tool_call>


class HermesToolParser(_JsonToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (``--tool-call-parser hermes``).

    A block whose body is not a call object (not JSON, no ``name``, other keys) is content,
    markup included. After the call object, anything before ``</tool_call>`` is dropped; a new
    ``<tool_call>`` there starts the next block.
    """

    markup_strings: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._state = _H.TEXT
        self._released = 0  # how much of the buffer is known to be text (given back by a non-call)

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        return hermes_call_grammar(tools, constraint)

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        while True:
            state = self._state
            if state is _H.TEXT:
                buf = self._buf
                pos = buf.find(TOOL_CALL_OPEN, self._released)
                if pos < 0:
                    cut = len(buf) if final else max(self._released, len(buf) - partial_tag_len(buf, (TOOL_CALL_OPEN,)))
                    self._emit_text(events, buf[:cut])
                    self._buf, self._released = buf[cut:], 0
                    return
                self._emit_text(events, buf[:pos])
                self._buf, self._released = buf[pos + len(TOOL_CALL_OPEN):], 0
                self._raw = TOOL_CALL_OPEN
                self._state = _H.OPEN
            elif state is _H.OPEN:
                head = self._buf.lstrip(_WHITESPACE)
                if not head and not final:
                    return
                if head.startswith("{"):
                    self._raw += self._buf[:len(self._buf) - len(head)]
                    self._buf = head
                    self._reader = JsonCallReader(self._allocate)
                    self._state = _H.CALL
                else:
                    self._give_back()
            elif state is _H.CALL:
                status = self._read_call(events, final)
                if status is CallStatus.READING:
                    return
                if status is CallStatus.NOT_A_CALL:
                    self._give_back(already_in_buffer=True)
                else:
                    self._state = _H.TAIL
            else:  # TAIL
                hit = find_first_tag(self._buf, (TOOL_CALL_CLOSE, TOOL_CALL_OPEN))
                if hit is None:
                    keep = 0 if final else partial_tag_len(self._buf, (TOOL_CALL_CLOSE, TOOL_CALL_OPEN))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                pos, tag = hit
                self._buf = self._buf[pos + len(tag):]
                if tag == TOOL_CALL_OPEN:
                    self._raw = TOOL_CALL_OPEN
                    self._state = _H.OPEN
                else:
                    self._skip_ws = True
                    self._state = _H.TEXT

    def _give_back(self, already_in_buffer: bool = False) -> None:
        """What was taken for a call is text: its markup (``<tool_call>`` and after) is not looked at again."""
        if not already_in_buffer:
            self._buf = self._raw + self._buf
        taken = len(TOOL_CALL_OPEN)
        self._raw = ""
        self._released = taken
        self._state = _H.TEXT


class _L(enum.Enum):
    START = "start"  # nothing decided: the reply may open with calls
    CALL = "call"
    BETWEEN = "between"  # after a call: ';' (or another '{') for the next one, else the rest is text
    TEXT = "text"  # the rest of the reply is content


class Llama3JsonToolParser(_JsonToolParser):
    """Llama 3 JSON tool calls (``--tool-call-parser llama3_json``).

    The reply is calls when, leading whitespace and ``<|python_tag|>`` aside, it opens with a call
    object; further calls follow after ``;`` (or directly). Whatever follows the last call, and
    a reply that opens with anything else (a JSON object that is no call included), is content.
    """

    markup_strings: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._state = _L.START

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        return llama3_json_call_grammar(tools, constraint)

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        while True:
            state = self._state
            if state is _L.START:
                head = self._buf.lstrip(_WHITESPACE)
                if not final and len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head):
                    return  # nothing yet, or what may still become the tag
                if head.startswith(PYTHON_TAG):
                    head = head[len(PYTHON_TAG):].lstrip(_WHITESPACE)
                    if not head and not final:
                        return
                if head.startswith("{"):
                    self._open_call(head)
                else:
                    self._state = _L.TEXT
            elif state is _L.CALL:
                status = self._read_call(events, final)
                if status is CallStatus.READING:
                    return
                if status is CallStatus.DONE:
                    self._state = _L.BETWEEN
                    self._skip_ws = True
                else:  # not a call (given back to the buffer), or broken: the rest is content
                    self._state = _L.TEXT
            elif state is _L.BETWEEN:
                head = self._buf.lstrip(_WHITESPACE)
                if head.startswith(";"):
                    head = head[1:].lstrip(_WHITESPACE)
                if not head and not final:
                    return
                if head.startswith("{"):
                    self._open_call(head)
                elif self._buf.strip(_WHITESPACE) == ";":  # a separator with nothing after it
                    self._buf = ""
                    return
                else:
                    self._state = _L.TEXT
            else:  # TEXT
                self._emit_text(events, self._buf)
                self._buf = ""
                return

    def _open_call(self, head: str) -> None:
        """``head``: the buffer from the call's '{'; what comes before it is markup given back on a non-call."""
        self._raw = self._buf[:len(self._buf) - len(head)]
        self._buf = head
        self._reader = JsonCallReader(self._allocate)
        self._state = _L.CALL
