"""OpenAI's error body, and the mapping from our exceptions to HTTP statuses.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

RequestError -> 400 (``param`` is the field), unknown model -> 404, bad or missing API key
-> 401, a body over ``server.max_body_bytes`` -> 413, QueueFullError and the concurrency limit
-> 429 (with ``Retry-After``), the engine starting, dead (EngineDeadError) or the server
shutting down -> 503 with one ``code`` per cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from fd_core.errors import EngineDeadError, QueueFullError, RequestError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

#: ``Retry-After`` of a 429, in seconds: the engine cannot tell when a slot frees, and one
#: second is what a client backing off would wait first anyway.
RETRY_AFTER_S: Final = 1

#: The ``code`` of each 503 (docs/server.md, "Errors").
ENGINE_STARTING: Final = "engine_starting"     # the engine is loading; retry shortly
ENGINE_DEAD: Final = "engine_dead"             # the engine process died (the message says how)
SHUTTING_DOWN: Final = "server_shutting_down"  # SIGTERM: draining, or server.shutdown_timeout_s ran out


class FieldConflict(ValueError):
    """Raised by a request model's cross-field check: the value of ``param`` (a field of the model
    that raises it) conflicts with another field's. The 400 names ``param``, where pydantic would
    name no field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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

    def headers(self) -> dict[str, str]:
        """HTTP headers of the response: ``Retry-After`` on a 429; ``Connection: close`` on a 408
        (the rest of the body it did not wait for is not read)."""
        if self.status == 429:
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {"Connection": "close"} if self.status == 408 else {}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param)


def too_many_requests(message: str) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def unavailable(message: str, code: str) -> ApiError:
    """A 503; ``code`` is :data:`ENGINE_STARTING`, :data:`ENGINE_DEAD` or :data:`SHUTTING_DOWN`."""
    return ApiError(503, message, type="service_unavailable_error", code=code)


def from_exception(exc: Exception) -> ApiError:
    """The API error for an exception raised while serving a request (500 for our own bugs)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.field)
    if isinstance(exc, QueueFullError):
        return too_many_requests(str(exc))
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), ENGINE_DEAD)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def from_validation_errors(errors: list[ErrorDetails]) -> ApiError:
    """400 for a body pydantic rejected, naming the first bad field (malformed JSON included)."""
    first = errors[0]
    param = _field_path(first["loc"])
    conflict = first.get("ctx", {}).get("error")
    if isinstance(conflict, FieldConflict):   # a model's cross-field check: the field it names
        param = f"{param}.{conflict.param}" if param else conflict.param
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
