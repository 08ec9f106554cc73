"""One access line per HTTP request (method, route, status, tokens, TTFT, duration); 4xx messages with it.

The middleware opens an ``AccessRecord`` for each request in a context variable, so whatever the
request's task (and the tasks it starts, such as a streaming body) does can add to it without the
record being passed around: ``ServerState.submit`` registers each engine stream (``note_stream``),
the error handlers note the message they answered (``note_error``), and a route that counts its
own tokens can say so (``note_usage``). The line is written when the response is complete.
"""
from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("armillary.access")

_current: ContextVar[AccessRecord | None] = ContextVar("armillary_access_record", default=None)


@dataclass(slots=True)
class AccessRecord:
    """What one HTTP request did; ``streams`` are the engine ``RequestStream`` objects it submitted."""

    start: float = field(default_factory=time.monotonic)
    streams: list[Any] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int | None = None  # set by note_usage; else summed over the streams
    output_tokens: int | None = None
    ttft: float | None = None  # seconds from the request's arrival to its first output

    def usage(self) -> tuple[int | None, int | None, float | None]:
        """(prompt tokens, output tokens, TTFT); None where nothing was generated."""
        prompt, output, ttft = self.prompt_tokens, self.output_tokens, self.ttft
        if self.streams:
            if prompt is None:
                prompt = sum(s.num_prompt_tokens for s in self.streams)
            if output is None:
                output = sum(s.num_tokens_seen for s in self.streams)
            firsts = [s.first_output_time for s in self.streams if s.first_output_time is not None]
            if ttft is None and firsts:
                ttft = min(firsts) - self.start
        return prompt, output, ttft


def current_record() -> AccessRecord | None:
    return _current.get()


def note_stream(stream: Any) -> None:
    """Count an engine request's tokens and first output in the current HTTP request's line."""
    record = _current.get()
    if record is not None:
        record.streams.append(stream)


def note_error(message: str) -> None:
    """The error message the current request was answered with (logged with its line)."""
    record = _current.get()
    if record is not None:
        record.error = message


def note_usage(prompt_tokens: int | None = None, output_tokens: int | None = None,
               ttft: float | None = None) -> None:
    """For a route whose tokens do not come from ``ServerState.submit`` streams."""
    record = _current.get()
    if record is None:
        return
    if prompt_tokens is not None:
        record.prompt_tokens = prompt_tokens
    if output_tokens is not None:
        record.output_tokens = output_tokens
    if ttft is not None:
        record.ttft = ttft


def access_line(method: str, path: str, status: int, record: AccessRecord, client: Any = None) -> str:
    who = f"{client[0]}:{client[1]} " if client else ""
    parts = [f'{who}"{method} {path}" {status}']
    prompt, output, ttft = record.usage()
    if prompt is not None:
        parts.append(f"prompt_tokens={prompt} output_tokens={output or 0}")
    if ttft is not None:
        parts.append(f"ttft={ttft:.3f}s")
    parts.append(f"duration={time.monotonic() - record.start:.3f}s")
    if record.error and status >= 400:
        parts.append(f"error={record.error!r}")
    return " ".join(parts)


class StatusTap:
    """An ASGI ``send`` that remembers the response status passing through it (500 until one does)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class AccessLogMiddleware:
    """Outermost middleware: opens the request's ``AccessRecord`` and logs its line at the end.

    2xx-4xx at info (a 4xx with the message the client got), 5xx at warning; an unhandled
    exception's traceback is logged by the app's 500 handler.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord()
        token = _current.set(record)
        tap = StatusTap(send)
        try:
            await self.app(scope, receive, tap)
        finally:
            _current.reset(token)
            status = tap.status
            level = logging.WARNING if status >= 500 else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s", access_line(scope["method"], scope["path"], status, record, scope.get("client")))
