"""Streaming parser for Gemma 4 tool calls (``--tool-call-parser gemma4``, the name vLLM / Atlas use).

``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, one block per call as the chat template writes
them (several ``call:`` entries in one block are read too). A call is emitted whole when its block
closes (its arguments as one JSON object); text around calls streams as it comes, with a partial
tag held back. Whitespace between calls, and the ``<|tool_response>`` marker a model may write
after its calls, are not content. A block that never closes or does not parse is content, as
written. The grammar for forced calls is ``gemma4_grammar.gemma4_call_grammar``.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import ClassVar

from armillary.parsers.base import BufferedMachine, ToolParser
from armillary.parsers.events import ParserEvent, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from armillary.parsers.scan import partial_tag_len
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary_gemma.parsers.gemma4_syntax import QUOTE, SyntaxError_, find_block_end, parse_calls

CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN = "<|tool_call>", "<tool_call|>", "<|tool_response>"


class _S(enum.Enum):
    TEXT = "text"
    BLOCK = "block"  # inside <|tool_call> ... <tool_call|>
    AFTER = "after"  # after a call: whitespace and <|tool_response> are markup, not content


class Gemma4ToolParser(BufferedMachine, ToolParser):
    markup_strings: ClassVar[tuple[str, ...]] = (CALL_OPEN, CALL_CLOSE, QUOTE, RESPONSE_OPEN)

    def __init__(self, tools: list[dict] | None, id_generator: Callable[[], str] | None = None) -> None:
        super().__init__(tools, id_generator)
        self._state = _S.TEXT
        self._buf = ""
        self._calls = 0

    @classmethod
    def tool_call_grammar(cls, tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
        from armillary_gemma.parsers.gemma4_grammar import gemma4_call_grammar

        return gemma4_call_grammar(tools, constraint)

    def _emit_calls(self, events: list[ParserEvent], calls: list[tuple[str, dict]]) -> None:
        for name, args in calls:
            index, arguments = self._calls, json.dumps(args, ensure_ascii=False)
            self._calls += 1
            events += [ToolCallStart(index, self.id_generator(), name), ToolCallArgsDelta(index, arguments),
                       ToolCallEnd(index, arguments)]

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        while True:
            if self._state is _S.TEXT:
                pos = self._buf.find(CALL_OPEN)
                cut = pos if pos >= 0 else len(self._buf) - (0 if final else partial_tag_len(self._buf, (CALL_OPEN,)))
                if cut:
                    events.append(TextDelta(self._buf[:cut]))
                if pos < 0:
                    self._buf = self._buf[cut:]
                    return
                self._buf, self._state = self._buf[pos + len(CALL_OPEN):], _S.BLOCK
            elif self._state is _S.BLOCK:
                end = find_block_end(self._buf, CALL_CLOSE)
                if end < 0 and not final:
                    return
                body = self._buf if end < 0 else self._buf[:end]
                try:
                    calls = parse_calls(body)
                except SyntaxError_:
                    calls = None
                if calls is None:  # not a call after all: the block is content as written
                    raw = CALL_OPEN + body + (CALL_CLOSE if end >= 0 else "")
                    events.append(TextDelta(raw))
                    self._buf, self._state = self._buf[len(raw) - len(CALL_OPEN):], _S.TEXT
                    continue
                self._emit_calls(events, calls)
                self._buf = "" if end < 0 else self._buf[end + len(CALL_CLOSE):]
                self._state = _S.AFTER
            else:  # AFTER: drop whitespace and <|tool_response>; anything else is text again
                head = self._buf.lstrip()
                if head.startswith(RESPONSE_OPEN):
                    self._buf = head[len(RESPONSE_OPEN):]
                    continue
                if head.startswith(CALL_OPEN):
                    self._buf, self._state = head, _S.TEXT
                    continue
                if not head:
                    if final:
                        self._buf = ""
                    return
                if not final and any(len(head) < len(t) and t.startswith(head) for t in (RESPONSE_OPEN, CALL_OPEN)):
                    return
                self._state = _S.TEXT  # text after the calls keeps its whitespace
