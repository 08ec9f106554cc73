"""Responses API wire shapes: parser events to output items and the ``response.*`` stream events, usage, the response object."""
from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from armillary.parsers.events import (
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

log = logging.getLogger("armillary.server")


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@dataclass(slots=True)
class ResponseHead:
    """What the response object repeats in every snapshot: id, model, and the request's echoed settings."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any] = field(default_factory=dict)  # instructions, tools, tool_choice, temperature, ...


def response_object(head: ResponseHead, status: str, output: list[dict], usage_obj: dict | None = None,
                    incomplete_reason: str | None = None, error: dict | None = None) -> dict:
    obj = {"id": head.id, "object": "response", "created_at": head.created_at, "status": status,
           "model": head.model, "output": output, "error": error,
           "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
           "usage": usage_obj, **head.echo}
    return obj


def status_of(engine_reason: str | None) -> tuple[str, str | None]:
    """Engine finish reason -> the response's status and incomplete reason."""
    if engine_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponseEventRenderer:
    """Parser events -> output items and the stream events that build them, in the documented order.

    A message: ``output_item.added``, ``content_part.added``, ``output_text.delta``…,
    ``output_text.done``, ``content_part.done``, ``output_item.done``; reasoning the same with
    ``reasoning_text``; a function call: ``output_item.added``, ``function_call_arguments.delta``…,
    ``function_call_arguments.done``, ``output_item.done``. Whitespace-only text is held back as in
    chat completions: dropped before a tool call, released otherwise.
    """

    def __init__(self) -> None:
        self.output: list[dict] = []  # finished and open items, in output order
        self.seq = 0
        self._open: dict | None = None  # the item receiving deltas
        self._calls: dict[int, dict] = {}  # parser call index -> its function_call item
        self._held_whitespace = ""
        self.num_reasoning_chars = 0

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def event(self, kind: str, **fields: Any) -> dict:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return payload

    def render(self, events: Sequence[ParserEvent]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                if ev.text:
                    self._delta(out, "reasoning", ev.text)
            elif isinstance(ev, TextDelta):
                text = self._visible(ev.text)
                if text:
                    self._delta(out, "message", text)
            elif isinstance(ev, ToolCallStart):
                self._held_whitespace = ""
                self._close(out, "completed")
                item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": ev.id, "name": ev.name, "arguments": ""}
                self._calls[ev.index] = item
                self._add(out, item)
            elif isinstance(ev, ToolCallArgsDelta):
                if ev.delta:
                    self._args(out, ev.index, ev.delta)
            elif isinstance(ev, ToolCallEnd):
                item = self._calls.get(ev.index)
                if item is None:
                    continue
                if ev.arguments != item["arguments"]:
                    if ev.arguments.startswith(item["arguments"]):
                        self._args(out, ev.index, ev.arguments[len(item["arguments"]):])
                    else:
                        log.warning("tool call %d: final arguments disagree with the streamed ones", ev.index)
                self._close(out, "completed")
        return out

    def finish(self, status: str) -> list[dict]:
        """The reply ended: release held whitespace (no calls), close the open item with ``status``."""
        out: list[dict] = []
        if self._held_whitespace and not self._calls:
            text, self._held_whitespace = self._held_whitespace, ""
            self._delta(out, "message", text)
        self._close(out, "completed" if status == "completed" else "incomplete")
        return out

    # ---- items

    def _visible(self, text: str) -> str:
        if self._open is not None and self._open["type"] == "message":
            return text
        if not text.strip():
            self._held_whitespace += text
            return ""
        text, self._held_whitespace = self._held_whitespace + text, ""
        return text

    def _add(self, out: list[dict], item: dict) -> None:
        self.output.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                              item=_snapshot(item)))

    def _delta(self, out: list[dict], kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close(out, "completed")
            if kind == "message":
                item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self._add(out, item)
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0, part=dict(part)))
        item = self._open
        item["content"][0]["text"] += text
        index = len(self.output) - 1
        if kind == "message":
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, logprobs=[]))
        else:
            self.num_reasoning_chars += len(text)
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text))

    def _args(self, out: list[dict], index: int, piece: str) -> None:
        item = self._calls.get(index)
        if item is None or item is not self._open:
            return
        item["arguments"] += piece
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.output.index(item), delta=piece))

    def _close(self, out: list[dict], status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        index = self.output.index(item)
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=_snapshot(item)))


def _snapshot(item: dict) -> dict:
    """A copy to send: later deltas must not change an event already rendered."""
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(p) for p in copy["content"]]
    return copy
