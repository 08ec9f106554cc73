"""Start-up warm requests: a chat and a completion, streamed and not, through the app in-process, before it listens.

The engine's warm-up (``armillary.warmup``) compiles every kernel, but a server's first request also
pays for Python's first use of its own path: anyio's event-loop backend and the thread pool that
renders and tokenizes, FastAPI and pydantic on the request models, the route handlers, the
hand-off to the engine thread and back, the parsers, the detokenizer and the SSE renderers,
sampling parameters built from generation_config and the model's mode defaults. So before the
socket is served, the server sends itself a few small requests through the real ASGI app (no
network, no HTTP client), with the default sampling. They count in no metric and write no
access line; afterwards the engine's bookkeeping is rebuilt (``forget_warm_requests``): nothing
held, no prefix-cache entry, no counter moved. Runs when the engine's warm-up switch is on.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from armillary.server.metrics import ServerMetrics
from armillary.server.state import ServerState
from armillary.warmup import forget_warm_requests

log = logging.getLogger("armillary.server")

_MAX_TOKENS = 8  # a few decode steps: continuation launches, text deltas, the finish chunk


@dataclass(slots=True)
class WarmReply:
    path: str
    streamed: bool
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return self.status == 200 and (not self.streamed or b'"error"' not in self.body)


class _Silence(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


async def asgi_request(app: ASGIApp, path: str, body: dict[str, Any], headers: dict[str, str]) -> WarmReply:
    """POST ``body`` to ``path`` of ``app`` in-process; the client stays until the reply is complete."""
    payload = json.dumps(body).encode()
    raw_headers = [(b"host", b"warm-up"), (b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": raw_headers, "client": ("127.0.0.1", 0), "server": ("warm-up", 0)}
    complete = asyncio.Event()
    delivered = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await complete.wait()  # a disconnect only once the whole reply is in
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                complete.set()

    try:
        await app(scope, receive, send)
    finally:
        complete.set()
    return WarmReply(path, bool(body.get("stream")), status, b"".join(chunks))


def warm_request_bodies(state: ServerState) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of each warm request, ``_MAX_TOKENS`` tokens each: the default sampling, the last one greedy."""
    model = state.served_model_names[0]
    tok = state.tokenizer
    common = {"model": model, "max_tokens": _MAX_TOKENS, "ignore_eos": True}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    bodies: list[tuple[str, dict[str, Any]]] = []
    if tok is not None and getattr(tok, "chat_templates", None):
        chat = {**common, "messages": [{"role": "user", "content": "Hello! Warming up."}]}
        bodies += [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, **usage}),
                   ("/v1/messages", {"model": model, "max_tokens": _MAX_TOKENS, "stream": True,
                                     "messages": [{"role": "user", "content": "Hello! Warming up."}]})]
    if tok is not None:
        bodies.append(("/v1/completions", {**common, "prompt": "Warming up the completions route"}))
    ids = tok.encode("Warming up with token ids") if tok is not None else list(range(1, 17))
    greedy = {**common, **usage, "temperature": 0.0, "prompt": ids[: max(1, state.max_model_len // 2)]}
    bodies.append(("/v1/completions", greedy))  # as benchmarks send: token ids, greedy
    return bodies


async def warm_routes(state: ServerState, app: ASGIApp, timeout_s: float = 120.0) -> list[WarmReply] | None:
    """Send the warm requests through ``app``, then rebuild the engine's bookkeeping; one log line with
    the time. None when the engine's warm-up switch is off (nothing is sent)."""
    engine = state.engine
    config = getattr(engine.engine, "config", None)
    if not getattr(config, "warmup", False):
        return None
    start = time.perf_counter()
    metrics, observer = state.metrics, engine.observer
    state.metrics = engine.observer = ServerMetrics(engine.stats)  # the warm requests count in no metric
    silence = _Silence()
    access = logging.getLogger("armillary.access")
    access.addFilter(silence)  # the access line is still built (its path warmed), not written
    headers = {"Authorization": f"Bearer {state.api_key}", "x-api-key": state.api_key} if state.api_key else {}
    replies: list[WarmReply] = []

    async def send_all() -> None:
        for path, body in warm_request_bodies(state):
            try:
                replies.append(await asgi_request(app, path, body, headers))
            except Exception as exc:  # the app's 500 handler answered and re-raised: serve anyway, say why
                replies.append(WarmReply(path, bool(body.get("stream")), 500, repr(exc).encode()))

    try:
        await asyncio.wait_for(send_all(), timeout_s)
    except asyncio.TimeoutError:
        log.warning("warm-up: the server's warm requests took over %.0f s; serving without the rest", timeout_s)
    finally:
        access.removeFilter(silence)
        state.metrics, engine.observer = metrics, observer
    for reply in replies:
        if not reply.ok:
            log.warning("warm-up: POST %s%s answered %d: %s", reply.path, " (streamed)" if reply.streamed else "",
                        reply.status, reply.body[:300].decode(errors="replace"))
    if engine.dead is None:
        await asyncio.wrap_future(engine.call(forget_warm_requests))
    log.info("warm-up: server routes (%d requests in-process) %.2f s", len(replies), time.perf_counter() - start)
    return replies
