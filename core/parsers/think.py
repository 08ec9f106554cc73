"""Generic ``<think>…</think>`` reasoning state machine; model families specialise it by class attributes."""
from __future__ import annotations

import enum
from typing import ClassVar

from armillary.parsers.base import BufferedMachine, ReasoningParser
from armillary.parsers.events import ParserEvent, ReasoningDelta, TextDelta
from armillary.parsers.scan import find_first_tag, partial_tag_len, undecided_prefix


class _State(enum.Enum):
    START = "start"  # nothing decided yet: the output may open with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkReasoningParser(BufferedMachine, ReasoningParser):
    """Reasoning between ``start_tag`` and ``end_tag``; everything after the end tag is content.

    - ``thinking_open=True``: the output starts inside reasoning (the template wrote the start
      tag); the model writes only the end tag. An output that never closes is all reasoning.
    - ``thinking_open=False``: the output is content unless it opens with the start tag
      (leading whitespace allowed); then it is reasoning up to the end tag.
    - A start tag the model writes itself at the very beginning is dropped in both cases.
    - Newlines the template puts around the block are not part of it: reasoning loses its
      leading newlines and the ones right before the end tag; content loses the newlines right
      after the end tag.
    - ``implicit_end_tag`` (optional): a tag that ends reasoning without the end tag and is
      passed on as content (models that open a tool call straight from reasoning); when
      ``implicit_end_confirm`` is set it only counts if that text follows, whitespace aside.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    implicit_end_tag: ClassVar[str | None] = None
    implicit_end_confirm: ClassVar[str | None] = None
    markup_strings: ClassVar[tuple[str, ...]] = ("<think>", "</think>")

    def __init__(self, thinking_open: bool) -> None:
        super().__init__(thinking_open)
        self._state = _State.START
        self._buf = ""  # text received but not yet turned into events
        self._strip_newlines = False  # drop newlines at the front of what comes next
        self._tags = (self.end_tag,) if self.implicit_end_tag is None else (self.end_tag, self.implicit_end_tag)

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        return prompt.rfind(cls.start_tag) > prompt.rfind(cls.end_tag)

    def _flush(self, events: list[ParserEvent]) -> None:
        if self._buf:  # final mode leaves only what could not be decided: release it as is
            events.append(ReasoningDelta(self._buf) if self._state is _State.REASONING else TextDelta(self._buf))
            self._buf = ""

    def _advance(self, events: list[ParserEvent], final: bool) -> None:
        while True:
            if self._state is _State.START:
                head = self._buf.lstrip()
                if head.startswith(self.start_tag):
                    self._buf = head[len(self.start_tag):]
                    self._enter(_State.REASONING, strip_newlines=True)
                    continue
                if not final and undecided_prefix(self._buf, self.start_tag):
                    return
                opened = _State.REASONING if self.thinking_open else _State.CONTENT
                self._enter(opened, strip_newlines=self.thinking_open)
                continue
            if self._strip_newlines:
                kept = self._buf.lstrip("\n")
                self._buf = kept
                if not kept:
                    return
                self._strip_newlines = False
            if self._state is _State.CONTENT:
                if self._buf:
                    events.append(TextDelta(self._buf))
                    self._buf = ""
                return
            if not self._reasoning_step(events, final):
                return

    def _reasoning_step(self, events: list[ParserEvent], final: bool) -> bool:
        """Consume reasoning text; True when a tag was consumed and the loop should go on."""
        buf = self._buf
        hit = find_first_tag(buf, self._tags)
        if hit is not None and hit[1] == self.end_tag:
            pos = hit[0]
            self._emit_reasoning(events, buf[:pos].rstrip("\n"))
            self._buf = buf[pos + len(self.end_tag):]
            self._enter(_State.CONTENT, strip_newlines=True)
            return True
        if hit is not None:  # the implicit end tag
            pos, tag = hit
            after = buf[pos + len(tag):]
            confirm = self.implicit_end_confirm
            if confirm is None or after.lstrip().startswith(confirm):
                self._emit_reasoning(events, buf[:pos].rstrip("\n"))
                self._buf = buf[pos:]
                self._enter(_State.CONTENT, strip_newlines=False)
                return True
            if not final and undecided_prefix(after, confirm):
                self._emit_up_to(events, pos)
                return False
            # not followed by the confirmation: the tag is plain reasoning text
            self._emit_reasoning(events, buf[:pos + len(tag)])
            self._buf = buf[pos + len(tag):]
            return True
        if final:
            self._emit_reasoning(events, buf)
            self._buf = ""
            return False
        self._emit_up_to(events, len(buf) - partial_tag_len(buf, self._tags))
        return False

    def _emit_up_to(self, events: list[ParserEvent], cut: int) -> None:
        """Emit reasoning before ``cut`` but hold a newline run ending there (it may precede a tag)."""
        while cut > 0 and self._buf[cut - 1] == "\n":
            cut -= 1
        self._emit_reasoning(events, self._buf[:cut])
        self._buf = self._buf[cut:]

    def _enter(self, state: _State, strip_newlines: bool) -> None:
        self._state = state
        self._strip_newlines = strip_newlines

    @staticmethod
    def _emit_reasoning(events: list[ParserEvent], text: str) -> None:
        if text:
            events.append(ReasoningDelta(text))
