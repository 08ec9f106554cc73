"""OpenAI wire shapes: parser events to chat deltas, chunks, whole responses, logprobs."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from armillary.outputs import TokenLogprob
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

# JSON has no -inf; a logprob this low means "never" to every client.
_MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > _MIN_LOGPROB else _MIN_LOGPROB


def finish_reason(engine_reason: str | None, has_tool_calls: bool) -> str | None:
    """Engine finish reason -> OpenAI's: a stop after tool calls is ``tool_calls``."""
    if engine_reason == "stop" and has_tool_calls:
        return "tool_calls"
    return engine_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---- logprobs

TokenText = Callable[[int], str]  # token id -> its text (special tokens included)


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`` for chat completions."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, text_offset: int) -> dict:
    """Legacy completions shape: parallel lists, ``top_logprobs`` as ``{token: logprob}`` maps."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(clamp_logprob(e.logprob))
        top.append({token_text(t): clamp_logprob(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# ---- chat messages

def tool_call_json(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_message(parsed: ParsedMessage) -> dict:
    """A whole assistant message; whitespace-only content next to tool calls becomes null."""
    content: str | None = parsed.content
    if parsed.tool_calls and not (content or "").strip():
        content = None
    message: dict = {"role": "assistant", "content": content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_json(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    return message


@dataclass(slots=True)
class _StreamedCall:
    arguments_sent: str = ""


class ChatDeltaRenderer:
    """One choice's parser events -> OpenAI ``delta`` objects, one per chunk.

    Consecutive text (or reasoning) events merge into one delta. Content that is only whitespace so
    far is held back: dropped if a tool call follows, released with the first visible character or
    at the end otherwise (the same content a non-streaming reply carries).
    """

    def __init__(self) -> None:
        self.calls: dict[int, _StreamedCall] = {}
        self._held_whitespace = ""
        self._content_started = False

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)

    def render(self, events: Sequence[ParserEvent], final: bool = False) -> list[dict]:
        deltas: list[dict] = []

        def extend(key: str, text: str) -> None:
            if deltas and set(deltas[-1]) == {key}:
                deltas[-1][key] += text
            else:
                deltas.append({key: text})

        for event in events:
            if isinstance(event, TextDelta):
                text = self._content(event.text)
                if text:
                    extend("content", text)
            elif isinstance(event, ReasoningDelta):
                if event.text:
                    extend("reasoning_content", event.text)
            elif isinstance(event, ToolCallStart):
                self._held_whitespace = ""
                self.calls[event.index] = _StreamedCall()
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallArgsDelta):
                if event.delta:
                    self._args(deltas, event.index, event.delta)
            elif isinstance(event, ToolCallEnd):
                call = self.calls.get(event.index)
                sent = call.arguments_sent if call is not None else ""
                if event.arguments != sent:
                    if event.arguments.startswith(sent):
                        self._args(deltas, event.index, event.arguments[len(sent):])
                    else:
                        log.warning("tool call %d: final arguments disagree with the streamed ones", event.index)
        if final and self._held_whitespace and not self.calls:
            extend("content", self._held_whitespace)
            self._held_whitespace = ""
        return deltas

    def _content(self, text: str) -> str:
        if self._content_started:
            return text
        if not text.strip():
            self._held_whitespace += text
            return ""
        self._content_started = True
        text, self._held_whitespace = self._held_whitespace + text, ""
        return text

    def _args(self, deltas: list[dict], index: int, piece: str) -> None:
        call = self.calls.setdefault(index, _StreamedCall())
        call.arguments_sent += piece
        last = deltas[-1] if deltas else None
        if last is not None and "tool_calls" in last and last["tool_calls"][-1]["index"] == index \
                and "function" in last["tool_calls"][-1]:
            last["tool_calls"][-1]["function"]["arguments"] += piece
        else:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})


# ---- envelopes

@dataclass(slots=True)
class ResponseHeader:
    """The fields every chunk of one response repeats."""

    id: str
    created: int
    model: str


def chat_chunk(head: ResponseHeader, index: int, delta: dict, finish: str | None = None,
               logprobs: dict | None = None, with_usage_field: bool = False) -> dict:
    chunk = {"id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": head.model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(head: ResponseHeader, obj: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    return {"id": head.id, "object": obj, "created": head.created, "model": head.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_chunk(head: ResponseHeader, index: int, text: str, finish: str | None = None,
                     logprobs: dict | None = None, with_usage_field: bool = False) -> dict:
    chunk = {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_response(head: ResponseHeader, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int = 0) -> dict:
    return {"id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_response(head: ResponseHeader, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
