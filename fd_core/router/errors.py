"""The router's own API errors, in OpenAI's error shape (:class:`fd_core.server.http_errors.ApiError`).

    503 no_backend       no backend can take the request; the message names each one and why
    502 backend_failed   the backend failed or timed out after the request reached it (non-streaming);
                         a stream gets the same body as an SSE error event, then ``data: [DONE]``
    429                  more than ``router.max_concurrency`` requests in flight
    413                  a body over ``router.max_body_bytes``
    408                  a body that took longer than ``router.body_timeout_s`` to arrive

A backend's own answers (400, 401, 404, 429 ...) are not built here: they pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from fd_core.router.choose import why_out
from fd_core.server.http_errors import ApiError, too_many_requests

if TYPE_CHECKING:
    from fd_core.router.backends import Backend

#: ``code`` of the 503 answered when no backend can take a request.
NO_BACKEND: Final = "no_backend"
#: ``code`` of the 502 (and of the stream's error event) when a backend failed while answering.
BACKEND_FAILED: Final = "backend_failed"


def no_backend(backends: Sequence[Backend], tried: Mapping[Backend, str]) -> ApiError:
    """503: every backend, each with why it is out (``tried``: the cause this request met)."""
    causes = [f"{b.name} ({'tried: ' + tried[b] if b in tried else why_out(b) or 'busy'})" for b in backends]
    return ApiError(503, "no backend can take the request: " + "; ".join(causes),
                    type="service_unavailable_error", code=NO_BACKEND)


def backend_failed(backend: Backend, cause: str, *, streaming: bool) -> ApiError:
    """502 (or a stream's error event): ``backend`` stopped answering after it had the request."""
    where = "mid-stream" if streaming else "before it answered"
    return ApiError(502, f"backend {backend.name} failed {where}: {cause}; the request was not completed",
                    type="server_error", code=BACKEND_FAILED)


def too_busy(in_flight: int, limit: int) -> ApiError:
    return too_many_requests(f"too many requests: {in_flight} in flight through the router, the most "
                             f"router.max_concurrency ({limit}) allows; retry later")



def body_too_slow(timeout_s: float) -> ApiError:
    """408: the client did not send its whole body within ``router.body_timeout_s``."""
    return ApiError(408, f"the request body did not arrive within router.body_timeout_s ({timeout_s:g} s); "
                         "send it at once, or raise router.body_timeout_s",
                    type="invalid_request_error", code="request_timeout")
