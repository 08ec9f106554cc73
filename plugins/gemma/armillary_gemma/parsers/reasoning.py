"""Gemma 4 thinking blocks (``--reasoning-parser gemma4_thinking``): ``<|channel>thought\\n…<channel|>``.

The chat template turns thinking on with ``<|think|>`` in the system turn; the model then opens a
channel named ``thought``, reasons, and closes it before its answer. Without thinking the template
(or the model) writes an empty ``<|channel>thought\\n<channel|>``, so the output is content. The
channel's name is markup, not reasoning text: it is dropped with the newline after it.
"""
from __future__ import annotations

from typing import ClassVar

from armillary.parsers.events import ParserEvent
from armillary.parsers.think import ThinkReasoningParser

CHANNEL = "thought"


class Gemma4ReasoningParser(ThinkReasoningParser):
    start_tag: ClassVar[str] = "<|channel>"
    end_tag: ClassVar[str] = "<channel|>"
    markup_strings: ClassVar[tuple[str, ...]] = ("<|channel>", "<channel|>", "<|think|>")

    def __init__(self, thinking_open: bool) -> None:
        super().__init__(thinking_open)
        self._label_pending = True  # a reasoning block may start with the channel's name

    def _reasoning_step(self, events: list[ParserEvent], final: bool) -> bool:
        if self._label_pending:
            buf = self._buf
            if not final and len(buf) < len(CHANNEL) and CHANNEL.startswith(buf):
                return False  # may still become the channel name
            self._label_pending = False
            if buf.startswith(CHANNEL):
                self._buf = buf[len(CHANNEL):]
                self._strip_newlines = True
                return True
        return super()._reasoning_step(events, final)
