"""What every route needs: the engine, the served names, parsers, metrics and the request limits."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from armillary.errors import InvalidRequestError
from armillary.server.access_log import note_stream
from armillary.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
    RequestStream,
)
from armillary.server.errors import APIError, bad_request, from_validation_error, overloaded
from armillary.server.limits import RequestLimits
from armillary.server.metrics import ServerMetrics
from armillary.server.parsing import ParserSetup
from armillary.server.responses_store import ResponseStore
from armillary.server.thinking import mode_defaults

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    parsers: ParserSetup
    metrics: ServerMetrics
    api_key: str | None = None
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_logprobs: int = 20  # --max-logprobs: the most logprobs / top_logprobs a request may ask for
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice (vLLM's flag)
    limits: RequestLimits = field(default_factory=RequestLimits)  # --max-n, --max-tools, --request-timeout, ...
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    max_thinking_budget: int | None = None  # --max-thinking-budget: the most reasoning tokens of any reply
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return dict(getattr(self.engine.engine, "generation_defaults", None) or {})

    def sampling_defaults(self, thinking: bool, tools: bool) -> dict[str, Any]:
        """Defaults of unset sampling knobs: generation_config.json, under ``--generation-config auto`` overlaid
        by the mode defaults the model's plugin declares (thinking on / off, with tools)."""
        defaults = self.generation_defaults
        engine = self.engine.engine
        if getattr(getattr(engine, "config", None), "generation_config", "auto") == "auto":
            modes = getattr(getattr(engine, "arch", None), "sampling_defaults", None) or {}
            defaults.update(mode_defaults(modes, thinking, tools))
        return defaults

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; an unknown name is a 404."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.served_model_names)}",
                           param="model", code="model_not_found")
        return requested

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs and token_strs show)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def submit(self, request_id: str, prompt: str | list[int], params: Any) -> RequestStream:
        """``AsyncEngine.submit`` with engine refusals mapped onto API errors."""
        self.require_ready()
        try:
            stream = await self.engine.submit(request_id, prompt, params)
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from exc
        except EngineOverloadedError as exc:
            raise overloaded(f"the server is overloaded: {exc}; retry later") from exc
        except (EngineUnavailableError, EngineDeadError) as exc:
            raise APIError(503, str(exc), code="unavailable", headers={"Retry-After": "5"}) from exc
        note_stream(stream)  # its tokens and first output go into this request's access line
        self.limits.arm_timeout(stream, self.engine.abort)
        return stream

    def require_ready(self) -> None:
        if not self.engine.ready:
            raise APIError(503, self.engine.not_ready_reason(), code="unavailable", headers={"Retry-After": "5"})


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 over ``limit`` bytes, 400 when it is not JSON or not an object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes, over the limit of {limit}", code="too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the decoder's own nesting limit
        raise bad_request("the request body nests too deeply to parse") from exc
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def parse_body(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def engine_error(exc: BaseException) -> APIError:
    """An error raised while streaming outputs (the engine died or is shutting down)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):  # not worth a retry here: this process exits, a supervisor restarts it
        return APIError(500, str(exc), code="engine_failed")
    return APIError(503, str(exc) or type(exc).__name__, code="unavailable")
