"""Read a request body, refusing with 413 one larger than the limit (``server.max_body_bytes``,
``router.max_body_bytes``) before it is all read.

A declared ``Content-Length`` over the limit is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused as soon as the count passes the limit, so
at most ``limit`` bytes (plus one network read) are ever held. uvicorn reads and discards the
unread rest on its own, and the connection stays usable.

:func:`check_values` bounds the work of parsing a body that was read: JSON values (a token id,
a string, a list...) are counted, without parsing, by the commas outside strings, and a body with
more than a limit of them is refused with 413 before it is parsed (3.9 M token ids, under the byte
limit, took seconds to parse with the GIL held and left the process hundreds of MiB larger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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


def check_values(body: bytes, limit: int, why: str) -> None:
    """Raise 413 when ``body`` holds more than ``limit`` JSON values (``why``: what bounds them)."""
    if len(body) // 2 < limit:   # every value but the last is followed by a comma
        return
    count = count_values(body)
    if count > limit:
        raise ApiError(413, f"the request body holds more than {limit} JSON values (token ids, strings, list "
                            f"items...; counted {count}): {why}; send fewer token ids",
                       type="invalid_request_error", code="request_too_large")


def count_values(body: bytes) -> int:
    """The JSON values in ``body`` (commas outside strings, plus one), without parsing it: a few
    vectorised passes over its bytes, however many values (a regex over millions of short strings
    took seconds)."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes and quotes
    chars = np.frombuffer(plain, dtype=np.uint8)
    in_string = np.cumsum(chars == ord('"'), dtype=np.uint8) & 1   # after an odd number of quotes
    return int(np.count_nonzero((chars == ord(",")) & (in_string == 0))) + 1


def _too_large(limit: int, limit_key: str, why: str) -> ApiError:
    return ApiError(413, f"the request body is too large ({why}); {limit_key} allows {limit} bytes: "
                         f"send a shorter prompt, or raise {limit_key}",
                    type="invalid_request_error", code="request_too_large")
