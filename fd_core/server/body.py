"""Read a request body, refusing with 413 one larger than the limit (``server.max_body_bytes``,
``router.max_body_bytes``) before it is all read.

A declared ``Content-Length`` over the limit is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused as soon as the count passes the limit, so
at most ``limit`` bytes (plus one network read) are ever held. uvicorn reads and discards the
unread rest on its own, and the connection stays usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fd_core.server.http_errors import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request


async def read_body(request: Request, limit: int, *, limit_key: str = "server.max_body_bytes") -> bytes:
    """The whole body of ``request``; raises 413 naming ``limit_key`` past ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, limit_key, f"its Content-Length is {int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, limit_key, f"more than {limit} bytes arrived")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int, limit_key: str, why: str) -> ApiError:
    return ApiError(413, f"the request body is too large ({why}); {limit_key} allows {limit} bytes: "
                         f"send a shorter prompt, or raise {limit_key}",
                    type="invalid_request_error", code="request_too_large")
