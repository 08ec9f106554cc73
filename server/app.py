"""The FastAPI application: the three protocols' routers, health (GET and HEAD), version, metrics, tokenize, auth, CORS, access log and error shapes."""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from armillary import __version__
from armillary.errors import InvalidRequestError
from armillary.server import anthropic_api, openai_api, responses_api
from armillary.server.access_log import AccessLogMiddleware, StatusTap, note_error
from armillary.server.errors import APIError, bad_request, describe_validation_errors, error_response
from armillary.server.metrics import CONTENT_TYPE
from armillary.server.prompts import openai_messages, openai_tools, render_chat, template_kwargs
from armillary.server.protocol_openai import DetokenizeRequest, TokenizeRequest
from armillary.server.state import ServerState, parse_body, read_json

log = logging.getLogger("armillary.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # answered without an API key


@dataclass(slots=True)
class CORSSettings:
    """``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` / ``--allow-credentials`` (vLLM's)."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False


class GatewayMiddleware:
    """Checks the API key on every route but health and metrics, and counts responses by status.

    OpenAI routes take ``Authorization: Bearer <key>``; Anthropic routes take ``x-api-key`` (or Bearer).
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        tap = StatusTap(send)
        try:
            if self.state.api_key and path not in OPEN_PATHS and not self._authorized(scope):
                err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                note_error(err.message)
                await error_response(err, path)(scope, receive, tap)
            else:
                await self.app(scope, receive, tap)
        finally:
            self.state.metrics.http_request(path, tap.status)

    def _authorized(self, scope: Scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        offered = []
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
        if scope["path"].startswith("/v1/messages") and "x-api-key" in headers:
            offered.append(headers["x-api-key"].strip())
        key = self.state.api_key.encode()
        return any(hmac.compare_digest(candidate.encode(), key) for candidate in offered)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        note_error(exc.message)
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        note_error(str(exc))
        return error_response(bad_request(str(exc)), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        note_error(f"invalid request: {message}")
        return error_response(bad_request(f"invalid request: {message}", param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        note_error(message)
        return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        note_error(f"internal error: {type(exc).__name__}: {exc}")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


def build_app(state: ServerState, cors: CORSSettings | None = None) -> FastAPI:
    """``cors``: answer browsers from those origins (CORS headers, preflights); None: no CORS headers."""
    app = FastAPI(title="armillary", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.armillary = state
    _install_error_handlers(app)
    app.include_router(openai_api.build_router(state))
    app.include_router(anthropic_api.build_router(state))
    app.include_router(responses_api.build_router(state))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers and `curl -I` probe with it
    async def health() -> JSONResponse:
        if state.engine.ready:
            return JSONResponse({"status": "ok"})
        raise APIError(503, state.engine.not_ready_reason(), code="unavailable", headers={"Retry-After": "5"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = parse_body(TokenizeRequest, await read_json(request, state.max_body_bytes))
        state.model_name(body.model)
        state.require_ready()
        tok = state.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            kwargs = template_kwargs(state.default_template_kwargs, body.chat_template_kwargs)
            rendered = await run_in_threadpool(render_chat, tok, openai_messages(body.messages),
                                               openai_tools(body.tools), kwargs, body.add_generation_prompt)
            ids = rendered.token_ids
        else:
            ids = await run_in_threadpool(tok.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [state.token_text(i) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = parse_body(DetokenizeRequest, await read_json(request, state.max_body_bytes))
        state.model_name(body.model)
        state.require_ready()
        tok = state.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer")
        vocab = tok.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return JSONResponse({"prompt": tok.decode(body.tokens)})

    app.add_middleware(GatewayMiddleware, state=state)
    if cors is not None:  # outside the key check: browsers send preflights without credentials
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    app.add_middleware(AccessLogMiddleware)  # outermost: every request gets its line
    return app
