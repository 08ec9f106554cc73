"""API errors and their two wire shapes (OpenAI and Anthropic), chosen by the request path."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# Anthropic names error types by meaning; the status picks one.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


# Pydantic names union members by type in error locations; they are not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    """An error answered to the client: HTTP status, message, and the OpenAI ``param`` / ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def not_supported(feature: str, param: str | None = None) -> APIError:
    return APIError(400, f"{feature} is not supported yet", param=param, code="not_supported")


def overloaded(message: str = "the server is overloaded: too many requests are waiting; retry later") -> APIError:
    return APIError(503, message, code="overloaded", headers={"Retry-After": "1"})


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_error_body(err: APIError) -> dict:
    default_type = "server_error" if err.status >= 500 else "invalid_request_error"
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, default_type),
                      "param": err.param, "code": err.code}}


def anthropic_error_body(err: APIError) -> dict:
    default_type = "api_error" if err.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, default_type),
                                       "message": err.message}}


def error_body(err: APIError, path: str) -> dict:
    return anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)


def error_response(err: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, path), status_code=err.status, headers=err.headers)


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic / FastAPI error list -> one readable message and the first offending field path."""
    parts: list[str] = []
    first_param: str | None = None
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p not in ("body",)]
        # pydantic adds the union member's type name to the location; it means nothing to a client
        loc = [p for p in loc if not p[:1].isupper() and "[" not in p and p not in _TYPE_TAGS]
        path = ".".join(loc)
        if first_param is None and path:
            first_param = path
        msg = e.get("msg", "invalid value")
        parts.append(f"{path}: {msg}" if path else msg)
    more = len(errors) - len(parts)
    message = "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
    return message, first_param


def from_validation_error(exc: ValidationError) -> APIError:
    message, param = describe_validation_errors(exc.errors(include_url=False))
    return bad_request(f"invalid request: {message}", param=param)
