"""Read a request body, refusing with 413 one larger than ``router.max_body_bytes`` before it is all read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fd_core.router.errors import body_too_large

if TYPE_CHECKING:
    from starlette.requests import Request


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of ``request`` (kept whole: a request that cannot reach one backend is sent to the next)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, f"its Content-Length is {int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit, f"more than {limit} bytes arrived")
        chunks.append(chunk)
    return b"".join(chunks)
