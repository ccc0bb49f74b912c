"""The HTTP/1.1 connection rules both fronts (fd-serve and the router) add to uvicorn's.

**Request heads.** A request head (request line and headers) of up to ``max_header_bytes``
(``server.max_header_bytes``, ``router.max_header_bytes``) is read whole, however its bytes
arrive; a longer one is answered 431 in OpenAI's error shape, naming the key, and the
connection is closed. uvicorn's h11 parser stops a head that is still incomplete past the limit
(:class:`HttpProtocol` answers it, where uvicorn answered a plain-text 400 and closed at once,
which reset the connection under the client's unread bytes); a head that arrived whole is
measured by :class:`HeadLimit`.

**Draining.** Once SIGTERM started the drain, every response carries ``Connection: close``
(:class:`CloseWhileDraining`): a request that arrives on a kept-alive connection then gets its
503 and the client opens no further request on that connection.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fd_core.server.error_handlers import respond
from fd_core.server.http_errors import ApiError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
    from uvicorn.config import Config
    from uvicorn.server import ServerState

#: How long a connection refused for its head stays open to read and drop what the client still
#: sends, so that closing it does not reset it before the client has read the answer (seconds).
LINGER_S: Final = 2.0

_CLOSE: Final = (b"connection", b"close")


def head_too_large(limit: int, limit_key: str) -> ApiError:
    """The 431 of a request head over ``limit`` bytes."""
    return ApiError(431, f"the request headers are too large: {limit_key} allows {limit} bytes of request line "
                         "and headers; send shorter headers (an API key, cookies), or raise it",
                    type="invalid_request_error", code="request_header_fields_too_large")


class HttpProtocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse in OpenAI's error shape: 431 for
    a head over the limit (``config.h11_max_incomplete_event_size``), else 400. The connection is
    closed after a pause in which the rest of what the client sent is read and dropped.
    ``functools.partial(HttpProtocol, limit_key=...)`` is uvicorn's ``http`` option."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limit_key: str) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limit_key = limit_key  # the key that sets the head limit
        self._refused = False

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size
        assert limit is not None, "the fronts set uvicorn's h11_max_incomplete_event_size"
        if len(self.conn.trailing_data[0]) > limit:
            error = head_too_large(limit, self._limit_key)
        else:
            error = ApiError(400, f"the request is not valid HTTP/1.1 ({msg})", type="invalid_request_error")
        self._refuse(error)

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error``, then close once the client closed or :data:`LINGER_S` passed."""
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), _CLOSE]
        for event in (h11.Response(status_code=error.status, headers=headers), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._refused = True
        self.transport.write_eof()   # the answer, then FIN: the client reads it and closes
        self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return   # the rest of a refused request: dropped
        super().data_received(data)


def uvicorn_options(limit: int, limit_key: str) -> dict[str, Any]:
    """The options of ``uvicorn.Config`` that limit request heads to ``limit`` bytes (set by ``limit_key``)."""
    return {"http": functools.partial(HttpProtocol, limit_key=limit_key), "h11_max_incomplete_event_size": limit}


class HeadLimit:
    """ASGI middleware: 431 for a request whose head arrived whole but is over ``limit`` bytes."""

    def __init__(self, app: ASGIApp, *, limit: int, limit_key: str) -> None:
        self.app = app
        self.limit = limit
        self.limit_key = limit_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _head_size(scope) > self.limit:
            response = respond(head_too_large(self.limit, self.limit_key))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _head_size(scope: Scope) -> int:
    """Bytes of the request line and header lines (as parsed: a few less than sent)."""
    line = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + len(" ? HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


class CloseWhileDraining:
    """ASGI middleware: once ``draining()`` is true, responses ask the client to close the connection."""

    def __init__(self, app: ASGIApp, *, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.draining():
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
            await send(message)

        await self.app(scope, receive, send_closing)
