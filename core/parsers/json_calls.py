"""Readers for JSON tool calls as they stream: a call object ``{"name": ..., "arguments": {...}}``, or a bare arguments object.

Both feed a ``JsonScanner`` one character at a time and stream the arguments' own text (as the
model wrote it: valid JSON by construction) up to the scanner's last safe point, so argument
deltas always concatenate to ``ToolCallEnd.arguments``, and a call cut off or broken midway
ends with the arguments closed at that point.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable

from armillary.parsers.events import ParserEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from armillary.parsers.json_scan import KEY_END, KEY_START, VALUE_END, VALUE_START, JsonScanner

NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")  # hermes writes the first, Llama 3 the second
_EMPTY = "{}"

Allocate = Callable[[str], tuple[int, str]]  # tool name -> (call index, call id), once per started call


class CallStatus(enum.Enum):
    READING = "reading"
    DONE = "done"  # the object closed (or the output ended) and the call, if any, was ended
    NOT_A_CALL = "not_a_call"  # no call started: ``raw`` is plain text after all
    BROKEN = "broken"  # a syntax error after the call started: the call was closed where it was safe


class _Arguments:
    """The arguments of one started call: raw text streamed up to the last safe point, then closed."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent = ""

    def emit(self, events: list[ParserEvent], text: str) -> None:
        if text:
            self.sent += text
            events.append(ToolCallArgsDelta(self.index, text))

    def end(self, events: list[ParserEvent], rest: str) -> None:
        self.emit(events, rest)
        events.append(ToolCallEnd(self.index, self.sent))


def _object_text(raw_value: str) -> str:
    """Arguments written as something other than an object: a string holding a JSON object is that object."""
    try:
        value = json.loads(raw_value)
        if isinstance(value, str):
            text = value.strip()
            if isinstance(json.loads(text), dict):
                return text
    except ValueError:
        pass
    return _EMPTY


class JsonCallReader:
    """Reads one call object, starting at its ``{``; ``feed`` returns how many characters it consumed.

    The call starts (``ToolCallStart``) once its ``name`` is known and its arguments begin, or
    when the object closes with a name and no arguments (``{}``). Keys other than ``name`` and
    ``arguments`` / ``parameters`` before that make the object plain text (a JSON reply, not a
    call); after it they are ignored, as are repeated argument keys. Arguments that are not an
    object become ``{}``, unless they are a string holding a JSON object.
    """

    def __init__(self, allocate: Allocate) -> None:
        self.allocate = allocate
        self.raw = ""
        self.status = CallStatus.READING
        self._scanner = JsonScanner()
        self._key: str | None = None  # the key of the value being read (depth 1)
        self._key_start = 0
        self._value_start = 0
        self._name: str | None = None
        self._args_key: str | None = None
        self._args_start = -1  # where an object-valued arguments value starts in ``raw``
        self._args_safe = -1  # end of its last safe prefix
        self._args_final: str | None = None  # arguments whose whole text is known
        self._call: _Arguments | None = None

    @property
    def started(self) -> bool:
        return self._call is not None

    def feed(self, text: str, events: list[ParserEvent]) -> int:
        consumed = 0
        scanner = self._scanner
        for char in text:
            if not scanner.step(char):
                self._fail(events)
                return consumed
            self.raw += char
            consumed += 1
            pos = len(self.raw) - 1
            for kind, depth, exclusive in scanner.events:
                self._on_event(kind, depth, pos if exclusive else pos + 1, pos, events)
                if self.status is not CallStatus.READING:
                    return consumed
            if self._args_start >= 0 and self._args_final is None and scanner.safe and scanner.depth >= 2:
                self._args_safe = len(self.raw)
        self._stream(events)
        return consumed

    def finish(self, events: list[ParserEvent]) -> None:
        """The output ended inside the object."""
        if self.status is not CallStatus.READING:
            return
        self._end(events)

    # -- internals -------------------------------------------------------------------------------

    def _end(self, events: list[ParserEvent]) -> None:
        """The object ended (closed, or the output did): a call if it had a name, else not a call."""
        if self._call is None and self._name is not None:
            self._start(events)
        if self._call is None:
            self.status = CallStatus.NOT_A_CALL
            return
        self._close(events)
        self.status = CallStatus.DONE

    def _on_event(self, kind: str, depth: int, end: int, pos: int, events: list[ParserEvent]) -> None:
        if depth == 0 and kind == VALUE_END:  # the call object itself closed
            self._end(events)
            return
        if depth != 1:
            return
        if kind == KEY_START:
            self._key_start = pos
        elif kind == KEY_END:
            self._key = json.loads(self.raw[self._key_start:end])
        elif kind == VALUE_START:
            self._value_start = pos
            self._on_value_start(events)
        elif kind == VALUE_END:
            self._on_value_end(self.raw[self._value_start:end], events)

    def _on_value_start(self, events: list[ParserEvent]) -> None:
        key = self._key
        if key in ARGUMENT_KEYS and self._args_key is None:
            self._args_key = key
            if self.raw[-1] == "{":
                self._args_start = self._value_start
                self._args_safe = len(self.raw)
            if self._name is not None and self._call is None:
                self._start(events)
        elif key != NAME_KEY and key not in ARGUMENT_KEYS and self._call is None:
            self.status = CallStatus.NOT_A_CALL

    def _on_value_end(self, value_text: str, events: list[ParserEvent]) -> None:
        key = self._key
        if key == NAME_KEY and self._name is None:
            name = json.loads(value_text)
            if not isinstance(name, str) or not name.strip():
                if self._call is None:
                    self.status = CallStatus.NOT_A_CALL
                return
            self._name = name
            if self._args_key is not None and self._call is None:
                self._start(events)
        elif key == self._args_key and self._args_final is None:
            self._args_final = value_text if self._args_start >= 0 else _object_text(value_text)
            if self._call is not None:
                self._stream(events)

    def _start(self, events: list[ParserEvent]) -> None:
        index, call_id = self.allocate(self._name)
        events.append(ToolCallStart(index, call_id, self._name))
        self._call = _Arguments(index)
        self._stream(events)

    def _stream(self, events: list[ParserEvent]) -> None:
        """Send what is decided of the arguments text."""
        call = self._call
        if call is None:
            return
        if self._args_final is not None:
            call.emit(events, self._args_final[len(call.sent):])
        elif self._args_start >= 0:
            call.emit(events, self.raw[self._args_start + len(call.sent):self._args_safe])

    def _close(self, events: list[ParserEvent]) -> None:
        call = self._call
        if self._args_final is not None:
            call.end(events, self._args_final[len(call.sent):])
        elif self._args_start >= 0:
            self._stream(events)
            call.end(events, self._scanner.closers(1))
        else:
            call.end(events, _EMPTY)

    def _fail(self, events: list[ParserEvent]) -> None:
        if self._call is None:
            self.status = CallStatus.NOT_A_CALL
            return
        self._stream(events)
        self._close(events)
        self.status = CallStatus.BROKEN


class JsonArgumentsReader:
    """The bare arguments object of a call whose tool is known in advance, starting at its ``{``.

    The call starts at the ``{``; it ends when the object closes, at a syntax error (BROKEN,
    closed at the last safe point) or when the output ends.
    """

    def __init__(self, index: int, call_id: str, name: str, events: list[ParserEvent]) -> None:
        self.status = CallStatus.READING
        self._scanner = JsonScanner()
        self._raw = ""
        self._safe = 0
        self._call = _Arguments(index)
        events.append(ToolCallStart(index, call_id, name))

    def feed(self, text: str, events: list[ParserEvent]) -> int:
        consumed = 0
        for char in text:
            if not self._scanner.step(char):
                self._end(events)
                self.status = CallStatus.BROKEN
                return consumed
            self._raw += char
            consumed += 1
            if self._scanner.safe:
                self._safe = len(self._raw)
            if self._scanner.done:
                self._end(events)
                self.status = CallStatus.DONE
                return consumed
        self._call.emit(events, self._raw[len(self._call.sent):self._safe])
        return consumed

    def finish(self, events: list[ParserEvent]) -> None:
        if self.status is CallStatus.READING:
            self._end(events)
            self.status = CallStatus.DONE

    def _end(self, events: list[ParserEvent]) -> None:
        closers = "" if self._scanner.done else self._scanner.closers(0)
        self._call.end(events, self._raw[len(self._call.sent):self._safe] + closers)
