"""Forward one request to the pool: pick a backend, send it the body as it came, relay its answer.

The body and the ``Authorization`` header go upstream unchanged; the backend's status and
body come back unchanged (its 400s, 401s, 429s...). Which backend answers:

1. :meth:`BackendPool.choose` picks the least loaded healthy one that has not been tried.
2. It cannot be connected to: it is marked down, and the next one is tried. It answers 503
   (starting, draining, its engine died): the request has not been served, so the next one is
   tried too. No backend left: 503 ``no_backend``, naming each backend and why it is out.
3. It fails after it had the request (connection lost, ``router.request_timeout_s`` of
   silence, or a poll finds it unreachable): 502 ``backend_failed`` when not streaming; a
   stream gets one SSE error event naming the backend, then ``data: [DONE]``. Nothing is
   retried then: the client may already have part of the answer, and the backend may have
   done the work.

A stream (``"stream": true`` and a 200) is relayed event by event as the bytes arrive (an
event cut between two reads waits for its end, so that an error event never lands inside
one). A client that goes away closes the upstream request, and the backend aborts its
request: a stream is cancelled by Starlette, and a non-streaming wait is watched with
``request.is_disconnected()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse

from fd_core.router.backends import describe_error
from fd_core.router.errors import backend_failed, no_backend, too_busy
from fd_core.router.metrics import BACKEND_ERROR, CLIENT_GONE, ERROR_STATUS, OK, UNREACHABLE
from fd_core.server import sse

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import Receive, Scope, Send

    from fd_core.router.backends import Backend, BackendPool
    from fd_core.router.config import RouterSection
    from fd_core.router.metrics import RouterMetrics
    from fd_core.server.http_errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a request waiting for a backend's answer checks that its client is still there (s).
DISCONNECT_POLL_S: Final = 0.5
#: Status logged (never seen by anyone) for a request whose client went away (nginx's convention).
CLIENT_CLOSED_REQUEST: Final = 499
#: Request headers sent upstream as they came (the body is sent unchanged too).
_UPSTREAM_HEADERS: Final = ("authorization", "content-type", "accept")
#: Response headers of a backend's buffered answer passed back to the client.
_DOWNSTREAM_HEADERS: Final = ("retry-after",)
#: Bodies up to this size (bytes) are looked into for ``"stream"`` on the event loop; larger ones on a thread.
_PARSE_INLINE_BYTES: Final = 64 * 1024
#: The end of an SSE event.
_EVENT_END: Final = b"\n\n"


class _ClientGone(Exception):
    """The client disconnected while the router waited for the backend."""


class _BackendLost(Exception):
    """A poll found the backend unreachable while a request waited for it."""


class _Incomplete(Exception):
    """The backend closed a stream cleanly but before its ``data: [DONE]``."""


@dataclass(slots=True, eq=False)
class _Attempt:
    """One backend working on one request: counted in its ``in_flight`` until :meth:`finish`."""

    backend: Backend
    metrics: RouterMetrics
    lost: asyncio.Event = field(init=False)  # the backend's lost event when the attempt began
    outcome: str | None = None

    def __post_init__(self) -> None:
        self.lost = self.backend.lost
        self.backend.in_flight += 1

    def finish(self, outcome: str) -> None:
        """Record how the attempt ended; only the first call counts."""
        if self.outcome is None:
            self.outcome = outcome
            self.backend.in_flight -= 1
            self.metrics.attempt(self.backend.name, outcome)


class Forwarder:
    """Sends requests to the pool's backends over one shared ``httpx.AsyncClient``."""

    def __init__(self, settings: RouterSection, pool: BackendPool, client: httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._max_concurrency = settings.max_concurrency
        self._timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s,
                                      pool=settings.connect_timeout_s)
        self.in_flight = 0  # generation requests through the router, streams until their end

    async def generate(self, request: Request, path: str, body: bytes) -> Response:
        """Forward a generation request (POST ``path``, its ``body`` read); holds one of
        ``router.max_concurrency`` slots until its answer ends."""
        if self.in_flight >= self._max_concurrency:
            raise too_busy(self.in_flight, self._max_concurrency)
        self.in_flight += 1
        handed_over = False  # once a stream is built, it frees the slot when it ends
        try:
            # a large body is parsed on a worker thread, so that streams and /health do not stall meanwhile
            stream = _wants_stream(body) if len(body) < _PARSE_INLINE_BYTES else await asyncio.to_thread(
                _wants_stream, body)
            response = await self.forward(request, "POST", path, body, stream=stream, on_stream_end=self._release)
            handed_over = isinstance(response, _Relay)
            return response
        finally:
            if not handed_over:
                self._release()

    def _release(self) -> None:
        assert self.in_flight > 0, "released a router slot that was not taken"
        self.in_flight -= 1

    async def forward(self, request: Request, method: str, path: str, body: bytes | None, *, stream: bool = False,
                      on_stream_end: Callable[[], None] | None = None) -> Response:
        """The answer of the first backend that can give one (see the module docstring)."""
        headers = {name: value for name in _UPSTREAM_HEADERS if (value := request.headers.get(name)) is not None}
        tried: dict[Backend, str] = {}
        while True:
            backend = self._pool.choose(exclude=set(tried))
            if backend is None:
                self._metrics.no_backend.inc()
                raise no_backend(self._pool.backends, tried)
            attempt = _Attempt(backend, self._metrics)
            upstream = self._client.build_request(method, backend.url + path, content=body, headers=headers,
                                                  timeout=self._timeout)
            try:
                response = await _while_connected(request, attempt, self._client.send(upstream, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                cause = describe_error(exc)
                attempt.finish(UNREACHABLE)
                self._pool.mark_down(backend, cause)
                tried[backend] = cause
                continue
            except _ClientGone:
                attempt.finish(CLIENT_GONE)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except (httpx.HTTPError, _BackendLost) as exc:
                raise self._failed(attempt, exc) from None
            except BaseException:  # cancelled: the server stops; the attempt ends with the request
                attempt.finish(CLIENT_GONE)
                raise
            if stream and response.status_code == 200:
                return _Relay(attempt, response, pool=self._pool, on_end=on_stream_end)
            try:
                content = await _while_connected(request, attempt, response.aread())
            except _ClientGone:
                attempt.finish(CLIENT_GONE)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except (httpx.HTTPError, _BackendLost) as exc:
                raise self._failed(attempt, exc) from None
            except BaseException:
                attempt.finish(CLIENT_GONE)
                raise
            finally:
                await response.aclose()
            attempt.finish(OK if response.status_code < 400 else ERROR_STATUS)
            if response.status_code == 503:  # not served there (starting, draining, engine dead): next one
                tried[backend] = f"answered 503: {_error_message(content)}"
                self._pool.recheck(backend)
                continue
            passed = {name: value for name in _DOWNSTREAM_HEADERS if (value := response.headers.get(name))}
            return Response(content, status_code=response.status_code, headers=passed,
                            media_type=response.headers.get("content-type"))

    def _failed(self, attempt: _Attempt, exc: httpx.HTTPError | _BackendLost) -> ApiError:
        """The 502 of a backend that failed ``attempt`` after it had the request (not retried)."""
        attempt.finish(BACKEND_ERROR)
        self._pool.recheck(attempt.backend)
        cause = describe_error(exc) if isinstance(exc, httpx.HTTPError) else attempt.backend.reason or "lost"
        log.warning("backend %s failed a request: %s", attempt.backend.name, cause)
        return backend_failed(attempt.backend, cause, streaming=False)


async def _while_connected(request: Request, attempt: _Attempt, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, unless the client disconnects (:class:`_ClientGone`) or a poll finds the
    backend unreachable (:class:`_BackendLost`) first; the awaitable is cancelled then."""
    task = asyncio.ensure_future(awaitable)
    lost = asyncio.ensure_future(attempt.lost.wait())
    try:
        while True:
            done, _ = await asyncio.wait({task, lost}, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if lost in done:
                raise _BackendLost
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # httpx closes the connection


def _wants_stream(body: bytes) -> bool:
    """Whether the body asks for ``"stream": true`` (a body that is no JSON object is the backend's to refuse)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode(errors="replace")


class _Relay(StreamingResponse):
    """A backend's SSE answer relayed as it arrives; ends the attempt exactly once, however it ends.

    (A generator's ``finally`` is not enough: a client that leaves before the first chunk can
    cancel the response before the generator ever starts.)
    """

    def __init__(self, attempt: _Attempt, upstream: httpx.Response, *, pool: BackendPool,
                 on_end: Callable[[], None] | None) -> None:
        self._attempt = attempt
        self._upstream = upstream
        self._pool = pool
        self._on_end = on_end
        self._step: asyncio.Future[bytes | None] | None = None  # the read in progress
        super().__init__(self._events(), media_type=upstream.headers.get("content-type", sse.MEDIA_TYPE),
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._attempt.finish(CLIENT_GONE)  # unless the stream ended first
            if self._on_end is not None:
                self._on_end()
            if self._step is not None and not self._step.done():
                self._step.cancel()
                await asyncio.gather(self._step, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._upstream.aclose()  # closes the connection: the backend aborts its request

    async def _events(self) -> AsyncIterator[bytes]:
        attempt = self._attempt
        chunks = self._upstream.aiter_bytes()
        lost = asyncio.ensure_future(attempt.lost.wait())
        pending = b""    # the start of an event whose end has not arrived
        done = False     # the backend's data: [DONE] went out
        try:
            while True:
                self._step = step = asyncio.ensure_future(anext(chunks, None))
                await asyncio.wait({step, lost}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise _BackendLost
                chunk = step.result()
                if chunk is None:
                    break
                pending += chunk
                cut = pending.rfind(_EVENT_END) + len(_EVENT_END)
                if cut >= len(_EVENT_END):
                    ready, pending = pending[:cut], pending[cut:]
                    done = ready.endswith(sse.DONE)
                    yield ready
                    if done:   # complete: a client that hangs up after [DONE] did not cut it short
                        attempt.finish(OK)
            if not done:
                raise _Incomplete
            attempt.finish(OK)
        except (httpx.HTTPError, _BackendLost, _Incomplete) as exc:
            if isinstance(exc, httpx.HTTPError):
                cause = describe_error(exc)
            elif isinstance(exc, _Incomplete):
                cause = "the stream ended without data: [DONE]"
            else:
                cause = attempt.backend.reason or "unreachable"
            attempt.finish(BACKEND_ERROR)
            self._pool.recheck(attempt.backend)
            log.warning("backend %s failed mid-stream: %s", attempt.backend.name, cause)
            if not done:  # a backend that sent [DONE] had finished: nothing is missing
                yield sse.event(backend_failed(attempt.backend, cause, streaming=True).body())
                yield sse.DONE
        finally:
            lost.cancel()

