"""Server-sent events, per-choice deltas of cumulative outputs, and client-disconnect handling."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from armillary.outputs import RequestOutput, TokenLogprob

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_data(obj: Any) -> str:
    """One OpenAI-style event: ``data: <json>``."""
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_event(name: str, obj: Any) -> str:
    """One named event (Anthropic style): ``event: <name>`` then ``data: <json>``."""
    return f"event: {name}\ndata: {dumps(obj)}\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops its generator as soon as the client goes away.

    Starlette only watches for the disconnect on older ASGI spec versions; this does it always and
    closes the body iterator either way, so the generator's ``finally`` aborts the request at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], status_code: int = 200) -> None:
        super().__init__(content, status_code=status_code, headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if streamer.done() and not streamer.cancelled() and streamer.exception() is not None:
            exc = streamer.exception()
            if not isinstance(exc, OSError):  # a send to a closed socket is a disconnect, not a bug
                raise exc


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client disconnects first; then cancel it and return None.

    Used by non-streaming endpoints after the body was read, so ``receive`` only reports the end.
    """
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained since the last output of its request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: int | str | None
    finished_now: bool  # this delta carries the choice's end


@dataclass(slots=True)
class _Seen:
    text_len: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    finished: bool = False


@dataclass(slots=True)
class OutputDeltas:
    """Turns the engine's cumulative ``RequestOutput`` stream into per-choice deltas."""

    seen: dict[int, _Seen] = field(default_factory=dict)

    def update(self, output: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for c in output.outputs:
            s = self.seen.setdefault(c.index, _Seen())
            if s.finished:
                continue
            # cumulative text only grows (the engine holds back possible stop-string prefixes)
            text = c.text[s.text_len:] if len(c.text) > s.text_len else ""
            s.text_len = max(s.text_len, len(c.text))
            new_ids = c.token_ids[s.num_tokens:]
            s.num_tokens = len(c.token_ids)
            new_lps: list[TokenLogprob] = []
            if c.logprobs is not None:
                new_lps = c.logprobs[s.num_logprobs:]
                s.num_logprobs = len(c.logprobs)
            done = c.finish_reason is not None
            s.finished = done
            if text or new_ids or done:
                deltas.append(ChoiceDelta(c.index, text, new_ids, new_lps, c.finish_reason, c.stop_reason, done))
        return deltas
