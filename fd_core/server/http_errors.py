"""OpenAI's error body, and the mapping from our exceptions to HTTP statuses.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

RequestError -> 400 (``param`` is the field), unknown model -> 404, bad or missing API key
-> 401, QueueFullError and the concurrency limit -> 429, EngineDeadError (starting, dead or
shutting down) -> 503.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fd_core.errors import EngineDeadError, QueueFullError, RequestError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class ApiError(Exception):
    """An error answered with an OpenAI error body; raise it from a route."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param)


def from_exception(exc: Exception) -> ApiError:
    """The API error for an exception raised while serving a request (500 for our own bugs)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.field)
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), type="service_unavailable_error", code="engine_unavailable")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def from_validation_errors(errors: list[ErrorDetails]) -> ApiError:
    """400 for a body pydantic rejected, naming the first bad field (malformed JSON included)."""
    first = errors[0]
    param = _field_path(first["loc"])
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}: not a field this server accepts (see the OpenAI API reference)"
    elif first["type"] == "missing":
        message = f"{param}: field required"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else msg
    if len(errors) > 1 and param is not None and all(_field_path(e["loc"]) == param for e in errors):
        # every member of a union type failed (prompt, stop, content...)
        message = f"{param}: wrong type or shape; none of its accepted forms matched (first: {first['msg']})"
    elif len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param)


#: Names pydantic puts in an error's ``loc`` for the member of a union that failed, not a field.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``, without union member tags."""
    parts = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part):
            break
        parts.append(str(part))
    return ".".join(parts) or None
