"""Anthropic wire shapes: parser events to content-block stream events, whole messages, stop reasons."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from armillary.parsers.base import ParsedMessage
from armillary.parsers.events import (
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

log = logging.getLogger("armillary.server")

StreamEvent = tuple[str, dict]  # (event name, payload)


def stop_reason(engine_reason: str | None, matched: int | str | None, stop_sequences: Sequence[str],
                has_tool_use: bool) -> tuple[str, str | None]:
    """Engine finish -> Anthropic ``(stop_reason, stop_sequence)``."""
    if engine_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict:
    """Tool-call arguments (JSON object text) as the ``input`` object; anything else becomes ``{}``."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        log.warning("tool call arguments are not JSON: %.200s", arguments)
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(parsed: ParsedMessage) -> list[dict]:
    """A whole reply's content: thinking, then text, then tool_use blocks."""
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    text = parsed.content or ""
    if text.strip() or (text and not blocks and not parsed.tool_calls):
        blocks.append({"type": "text", "text": text})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    return blocks


def message_json(message_id: str, model: str, content: list[dict], stop: str | None, stop_sequence: str | None,
                 input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """``input_tokens``: the whole prompt; Anthropic counts the part read from the cache apart."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens - cached_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}}


def message_start(message_id: str, model: str, input_tokens: int) -> StreamEvent:
    return "message_start", {"type": "message_start",
                             "message": message_json(message_id, model, [], None, None, input_tokens, 0)}


def message_end(stop: str, stop_sequence: str | None, output_tokens: int, input_tokens: int | None = None,
                cached_tokens: int = 0) -> list[StreamEvent]:
    """The closing events; with ``input_tokens`` the usage also says how much of the prompt was cached
    (message_start went out before the engine knew)."""
    usage: dict = {"output_tokens": output_tokens}
    if input_tokens is not None:
        usage.update(input_tokens=input_tokens - cached_tokens, cache_read_input_tokens=cached_tokens)
    return [("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": stop, "stop_sequence": stop_sequence},
                               "usage": usage}),
            ("message_stop", {"type": "message_stop"})]


PING: StreamEvent = ("ping", {"type": "ping"})


class BlockStreamRenderer:
    """Parser events -> ``content_block_start`` / ``_delta`` / ``_stop`` events, one block open at a time.

    Text that is only whitespace before a block opens is held back: dropped if a tool call follows,
    released with the next visible text, or emitted at the end when no block was sent at all.
    """

    def __init__(self) -> None:
        self.num_blocks = 0
        self.has_tool_use = False
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._open_call: int | None = None  # the parser's index of the open tool call
        self._call_sent: dict[int, str] = {}  # arguments streamed per tool call
        self._held_whitespace = ""

    def render(self, events: Sequence[ParserEvent], final: bool = False) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                if event.text:
                    self._ensure(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, TextDelta):
                self._text(out, event.text)
            elif isinstance(event, ToolCallStart):
                self._held_whitespace = ""
                self._close(out)
                self.has_tool_use = True
                self._call_sent[event.index] = ""
                self._start(out, "tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
                self._open_call = event.index
            elif isinstance(event, ToolCallArgsDelta):
                if event.delta:
                    self._args(out, event.index, event.delta)
            elif isinstance(event, ToolCallEnd):
                sent = self._call_sent.get(event.index, "")
                if event.arguments != sent and event.arguments.startswith(sent):
                    self._args(out, event.index, event.arguments[len(sent):])
                if self._open == "tool_use" and self._open_call == event.index:
                    self._close(out)
        if final:
            if self._held_whitespace and self.num_blocks == 0:
                self._text(out, "", flush=True)
            self._close(out)
        return out

    def _text(self, out: list[StreamEvent], text: str, flush: bool = False) -> None:
        if self._open != "text":
            if not flush and not text.strip():
                self._held_whitespace += text
                return
            text, self._held_whitespace = self._held_whitespace + text, ""
            self._ensure(out, "text", {"type": "text", "text": ""})
        if text:
            out.append(self._delta({"type": "text_delta", "text": text}))

    def _args(self, out: list[StreamEvent], index: int, piece: str) -> None:
        if self._open != "tool_use" or self._open_call != index:
            log.warning("arguments for tool call %d arrived outside its block; dropped", index)
            return
        self._call_sent[index] = self._call_sent.get(index, "") + piece
        out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))

    def _ensure(self, out: list[StreamEvent], kind: str, block: dict) -> None:
        if self._open != kind:
            self._close(out)
            self._start(out, kind, block)

    def _start(self, out: list[StreamEvent], kind: str, block: dict) -> None:
        out.append(("content_block_start", {"type": "content_block_start", "index": self.num_blocks,
                                            "content_block": block}))
        self._open = kind

    def _delta(self, delta: dict) -> StreamEvent:
        return "content_block_delta", {"type": "content_block_delta", "index": self.num_blocks, "delta": delta}

    def _close(self, out: list[StreamEvent]) -> None:
        if self._open is None:
            return
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.num_blocks}))
        self._open = None
        self._open_call = None
        self.num_blocks += 1
