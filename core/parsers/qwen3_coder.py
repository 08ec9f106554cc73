"""Streaming parser for Qwen3-Coder / Qwen3.5 XML-style tool calls (``--tool-call-parser qwen3_coder``).

The model writes::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

one block per call (several per turn). Values are raw text typed by the tool's JSON schema.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import ClassVar

from armillary.parsers.base import BufferedMachine, ToolParser
from armillary.parsers.events import ParserEvent, TextDelta
from armillary.parsers.scan import find_first_tag, partial_tag_len, undecided_prefix
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary.parsers.qwen3_coder_grammar import qwen3_coder_call_grammar
from armillary.parsers.xml_args import XmlArguments

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_NAME_BREAKERS = ("\n", "<")  # a tag name never spans these: the header is malformed


class _State(enum.Enum):
    TEXT = "text"  # content, looking for <tool_call>
    CALL_OPEN = "call_open"  # after <tool_call>, expecting <function=
    FUNCTION_NAME = "function_name"  # after <function=, up to >
    FUNCTION_BODY = "function_body"  # between parameters
    PARAMETER_NAME = "parameter_name"  # after <parameter=, up to >
    PARAMETER_VALUE = "parameter_value"  # up to </parameter>
    CALL_TAIL = "call_tail"  # after </function>, expecting </tool_call> (or another <function=)


def _drop_one_trailing_newline(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


class Qwen3CoderToolParser(BufferedMachine, ToolParser):
    """qwen3_coder tool calls as ``ToolCallStart`` / ``ToolCallArgsDelta`` / ``ToolCallEnd`` events.

    Arguments are a JSON object written with ``json.dumps`` separators (``", "``, ``": "``) and
    ``ensure_ascii=False``; the argument deltas of a call concatenate to exactly
    ``ToolCallEnd.arguments``. ``ToolCallStart`` goes out when ``<function=NAME>`` is complete,
    with ``{``; a string-typed parameter streams its escaped text as it arrives; any other
    parameter goes out whole at ``</parameter>``; ``}`` and ``ToolCallEnd`` at ``</function>``.
    Values: one newline after ``<parameter=P>`` and one before ``</parameter>`` are dropped, the
    literal ``null`` is JSON null, the rest follows ``convert_argument`` (a parameter or tool the
    schema does not know is untyped: JSON if it parses, else the text). A repeated parameter is
    written twice (JSON readers keep the last).

    Content: text before, between and after calls is kept verbatim, except the whitespace that
    directly follows a call (so whitespace-only text between or after calls disappears).

    Malformed or unterminated calls: a ``<tool_call>`` not followed by a well-formed
    ``<function=NAME>`` header is released as text, markup included. Once the header is
    complete the call has started and is always closed: at ``finish()`` a truncated parameter
    keeps the text that arrived (a partly written ``</parameter>`` is dropped), a parameter
    whose name is cut off is dropped, and the call ends with what it has.
    """

    markup_strings: ClassVar[tuple[str, ...]] = (
        TOOL_CALL_OPEN, TOOL_CALL_CLOSE, FUNCTION_OPEN, FUNCTION_CLOSE, PARAMETER_OPEN, PARAMETER_CLOSE,
    )

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._state = _State.TEXT
        self._buf = ""  # received, not yet turned into events
        self._raw = ""  # markup consumed since <tool_call>, released as text if the header is malformed
        self._calls = 0  # calls started so far
        self._skip_ws = False  # just after a call: whitespace is dropped
        self._arguments = XmlArguments()  # the open call's arguments and parameter
        self._lead_checked = False  # the newline after <parameter=P> was looked for
        self._scan_from = 0  # where to resume looking for </parameter> in a held value

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        return qwen3_coder_call_grammar(tools, constraint)

    def _flush(self, events: list[ParserEvent]) -> None:
        if self._state is _State.FUNCTION_BODY:  # final mode leaves a started call here: close it
            self._close_call(events)
            self._state = _State.TEXT

    # -- the state machine ---------------------------------------------------------------------

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        handlers = {
            _State.TEXT: self._on_text,
            _State.CALL_OPEN: self._on_call_open,
            _State.FUNCTION_NAME: self._on_function_name,
            _State.FUNCTION_BODY: self._on_function_body,
            _State.PARAMETER_NAME: self._on_parameter_name,
            _State.PARAMETER_VALUE: self._on_parameter_value,
            _State.CALL_TAIL: self._on_call_tail,
        }
        while handlers[self._state](events, final):
            pass

    def _on_text(self, events: list[ParserEvent], final: bool) -> bool:
        buf = self._buf
        pos = buf.find(TOOL_CALL_OPEN)
        if pos >= 0:
            self._emit_text(events, buf[:pos])
            self._buf = buf[pos + len(TOOL_CALL_OPEN):]
            self._raw = TOOL_CALL_OPEN
            self._state = _State.CALL_OPEN
            return True
        cut = len(buf) if final else len(buf) - partial_tag_len(buf, (TOOL_CALL_OPEN,))
        self._emit_text(events, buf[:cut])
        self._buf = buf[cut:]
        return False

    def _on_call_open(self, events: list[ParserEvent], final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(FUNCTION_OPEN):
            self._raw += self._buf[:len(self._buf) - len(head)] + FUNCTION_OPEN
            self._buf = head[len(FUNCTION_OPEN):]
            self._state = _State.FUNCTION_NAME
            return True
        if not final and undecided_prefix(self._buf, FUNCTION_OPEN):
            return False
        self._release_raw(events)
        return True

    def _on_function_name(self, events: list[ParserEvent], final: bool) -> bool:
        name = self._read_tag_name(final)
        if name is None:
            return False
        if name:
            self._start_call(events, name)
            self._state = _State.FUNCTION_BODY
        else:
            self._release_raw(events)
        return True

    def _on_function_body(self, events: list[ParserEvent], final: bool) -> bool:
        tag = self._skip_to_tag((PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE), final)
        if tag is None:
            return False
        if tag == PARAMETER_OPEN:
            self._state = _State.PARAMETER_NAME
            return True
        self._close_call(events)
        if tag == FUNCTION_CLOSE:
            self._state = _State.CALL_TAIL
        else:
            self._end_block()
        return True

    def _on_parameter_name(self, events: list[ParserEvent], final: bool) -> bool:
        name = self._read_tag_name(final)
        if name is None:
            return False
        if name:
            self._begin_parameter(name)
            self._state = _State.PARAMETER_VALUE
        else:  # malformed parameter header: skip to the next tag
            self._state = _State.FUNCTION_BODY
        return True

    def _on_parameter_value(self, events: list[ParserEvent], final: bool) -> bool:
        if not self._lead_checked:
            if not self._buf and not final:
                return False
            if self._buf.startswith("\n"):
                self._buf = self._buf[1:]
            self._lead_checked = True
        buf = self._buf
        pos = buf.find(PARAMETER_CLOSE, self._scan_from)
        if pos >= 0 or final:
            end = pos if pos >= 0 else len(buf) - partial_tag_len(buf, (PARAMETER_CLOSE,))
            self._arguments.finish_value(events, _drop_one_trailing_newline(buf[:end]))
            self._buf = buf[pos + len(PARAMETER_CLOSE):] if pos >= 0 else ""
            self._state = _State.FUNCTION_BODY
            return True
        if self._arguments.streams:
            cut = len(buf) - partial_tag_len(buf, (PARAMETER_CLOSE,))
            if cut > 0 and buf[cut - 1] == "\n":  # may be the newline before </parameter>
                cut -= 1
            self._arguments.stream(events, buf[:cut])
            self._buf = buf[cut:]
        else:
            self._scan_from = max(0, len(buf) - len(PARAMETER_CLOSE) + 1)
        return False

    def _on_call_tail(self, events: list[ParserEvent], final: bool) -> bool:
        tag = self._skip_to_tag((TOOL_CALL_CLOSE, FUNCTION_OPEN, TOOL_CALL_OPEN), final)
        if tag is None:
            return False
        if tag == FUNCTION_OPEN:  # another call inside the same block
            self._raw = FUNCTION_OPEN
            self._state = _State.FUNCTION_NAME
        elif tag == TOOL_CALL_OPEN:  # the block was never closed; a new one starts
            self._raw = TOOL_CALL_OPEN
            self._state = _State.CALL_OPEN
        else:
            self._end_block()
        return True

    # -- helpers -------------------------------------------------------------------------------

    def _read_tag_name(self, final: bool) -> str | None:
        """The name up to ``>`` (then consumed); "" if malformed (nothing consumed); None while undecided."""
        buf = self._buf
        end = buf.find(">")
        breaks = [i for i in (buf.find(b) for b in _NAME_BREAKERS) if i >= 0]
        broken_at = min(breaks) if breaks else -1
        if end >= 0 and (broken_at < 0 or end < broken_at):
            name = buf[:end].strip()
            if name:
                self._buf = buf[end + 1:]
            return name
        if broken_at < 0 and not final:
            return None
        return ""

    def _skip_to_tag(self, tags: tuple[str, ...], final: bool) -> str | None:
        """Drop text up to and including the first of ``tags``; None (holding a partial tag) if none."""
        hit = find_first_tag(self._buf, tags)
        if hit is None:
            keep = 0 if final else partial_tag_len(self._buf, tags)
            self._buf = self._buf[len(self._buf) - keep:]
            return None
        pos, tag = hit
        self._buf = self._buf[pos + len(tag):]
        return tag

    def _emit_text(self, events: list[ParserEvent], text: str) -> None:
        """Content; whitespace right after a call is dropped."""
        if self._skip_ws:
            text = text.lstrip()
            self._skip_ws = not text
        if text:
            events.append(TextDelta(text))

    def _release_raw(self, events: list[ParserEvent]) -> None:
        """A malformed call header: what was taken for markup is content after all."""
        self._emit_text(events, self._raw)
        self._raw = ""
        self._state = _State.TEXT

    def _end_block(self) -> None:
        self._skip_ws = True
        self._state = _State.TEXT

    def _start_call(self, events: list[ParserEvent], name: str) -> None:
        index = self._calls
        self._calls += 1
        self._raw = ""
        self._arguments.start_call(events, index, self.id_generator(), name, self.parameter_schemas.get(name))

    def _close_call(self, events: list[ParserEvent]) -> None:
        self._arguments.close_call(events)

    def _begin_parameter(self, name: str) -> None:
        self._arguments.begin_value(name)
        self._lead_checked = False
        self._scan_from = 0
