"""The FastAPI application: both protocols' routers, health, metrics, tokenize, auth and error shapes."""
from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from armillary.errors import InvalidRequestError
from armillary.server import anthropic_api, openai_api
from armillary.server.errors import APIError, bad_request, describe_validation_errors, error_response
from armillary.server.metrics import CONTENT_TYPE
from armillary.server.prompts import openai_messages, openai_tools, render_chat, template_kwargs
from armillary.server.protocol_openai import DetokenizeRequest, TokenizeRequest
from armillary.server.state import ServerState, parse_body, read_json

log = logging.getLogger("armillary.server")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without an API key


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
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.state.api_key and path not in OPEN_PATHS and not self._authorized(scope):
                err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                await error_response(err, path)(scope, receive, send_counting)
            else:
                await self.app(scope, receive, send_counting)
        finally:
            self.state.metrics.http_request(path, status)

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
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(bad_request(str(exc)), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(bad_request(f"invalid request: {message}", param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="armillary", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.armillary = state
    _install_error_handlers(app)
    app.include_router(openai_api.build_router(state))
    app.include_router(anthropic_api.build_router(state))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine.ready:
            return JSONResponse({"status": "ok"})
        raise APIError(503, state.engine.not_ready_reason(), code="unavailable", headers={"Retry-After": "5"})

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
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
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
    return app
