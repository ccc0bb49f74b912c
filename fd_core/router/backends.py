"""The pool of backends: what the router last learnt of each fd-serve instance, kept fresh by polling.

Each backend's ``GET /health`` is polled every ``router.health_interval_s`` by a task of its own
(so a slow backend delays no other's poll), and at once after a request found it failing
(:meth:`BackendPool.recheck`). A poll records the backend's status, role, load and reason;
a poll that fails marks it ``down`` with the cause. Requests mark a backend ``down`` too when
they cannot connect to it (:meth:`BackendPool.mark_down`), without waiting for the poll.

A backend a poll finds *unreachable* (no new TCP connection: the process or host is gone) sets its
:attr:`Backend.lost` event, which ends every stream still relayed from it at once, rather than
after ``router.request_timeout_s`` of silence. A backend that is only slow to answer ``/health``
is marked down for new requests, but its streams go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import httpx

from fd_core.redact import redacted_url
from fd_core.router.choose import HEALTHY, choose, why_out

if TYPE_CHECKING:
    from fd_core.router.config import RouterSection

log = logging.getLogger(__name__)

#: ``status`` of a backend before its first poll answered or failed.
UNKNOWN: Final = "unknown"
#: ``status`` of a backend whose last poll failed, or that a request could not connect to.
DOWN: Final = "down"
#: The statuses an fd-serve /health reports (docs/server.md); anything else reads as ``unknown``.
_REPORTED: Final = frozenset({"ok", "degraded", "starting", "draining", "dead"})
#: Transport errors that mean the backend cannot be reached at all (its streams are lost): a new
#: TCP connection could not be made.
UNREACHABLE_ERRORS: Final = (httpx.ConnectError, httpx.ConnectTimeout)
#: Errors of a kept-alive connection the backend closed (or died on): the poll is tried once more,
#: on a new connection, which tells a dead backend from a closed connection.
_CLOSED_CONNECTION_ERRORS: Final = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def describe_error(exc: BaseException) -> str:
    """A short cause for a failed HTTP exchange: ``cannot connect: [Errno 111] Connection refused``."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "cannot connect: timed out"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {_os_cause(exc) or str(exc) or type(exc).__name__}"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return f"connection lost: {str(exc) or type(exc).__name__}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _os_cause(exc: BaseException) -> str | None:
    """The operating system's word for a failed connect (``connection refused``), found down the
    exception chain (httpx only says "All connection attempts failed")."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain is short; never loop on a cyclic one
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno is not None:
            return f"[Errno {seen.errno}] {os.strerror(seen.errno).lower()}"
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(slots=True, eq=False)
class Backend:
    """One fd-serve instance as the router sees it (identity-compared: one object per URL)."""

    url: str                              # base URL, no trailing "/" (router.backends entry)
    status: str = UNKNOWN                 # its /health status; "down" (unreachable) or "unknown" (not polled)
    role: str | None = None               # "mixed", "prefill" or "decode" (splitwise.role), once polled
    load: dict[str, Any] | None = None    # its /health "load" (running, waiting, in_flight, free_blocks, num_blocks)
    reason: str | None = None             # why it is not ok: its own /health reason, or the router's
    last_error: str | None = None         # the last failure the router saw (poll or request), kept after recovery
    checked_at: float | None = None       # time.monotonic() of the last poll's end
    in_flight: int = 0                    # requests the router has sent it and not finished
    #: Set when it is found unreachable; replaced by a fresh event once it answers again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)  # recheck(): poll now

    @property
    def healthy(self) -> bool:
        return self.status in HEALTHY

    @property
    def name(self) -> str:
        """The URL as shown (``/health``, ``/metrics``, errors, logs): any ``user:password@`` removed."""
        return redacted_url(self.url)

    def public(self) -> dict[str, Any]:
        """The backend's entry in the router's ``/health``."""
        reason = self.reason if self.reason is not None else why_out(self)
        return {"url": self.name, "status": self.status, "role": self.role, "load": self.load, "reason": reason,
                "in_flight": self.in_flight, "last_error": self.last_error}


class BackendPool:
    """The backends of ``router.backends``, polled while :meth:`start` ... :meth:`close` runs."""

    def __init__(self, settings: RouterSection, client: httpx.AsyncClient) -> None:
        self.backends: list[Backend] = [Backend(url) for url in settings.backends]
        self._client = client
        self._interval = settings.health_interval_s
        self._timeout = httpx.Timeout(settings.health_timeout_s, connect=settings.connect_timeout_s)
        self._next = 0  # round-robin position among equally loaded backends
        self._pollers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Poll every backend once (so that the first requests find them), then keep polling."""
        await asyncio.gather(*(self.poll(backend) for backend in self.backends))
        self._pollers = [asyncio.create_task(self._poll_forever(backend), name=f"fd-router-poll {backend.name}")
                         for backend in self.backends]

    async def close(self) -> None:
        for task in self._pollers:
            task.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)
        self._pollers = []

    def choose(self, exclude: set[Backend]) -> Backend | None:
        """The backend for the next request (see :mod:`fd_core.router.choose`), or None."""
        backend = choose(self.backends, exclude=exclude, after=self._next)
        if backend is not None:
            self._next = self.backends.index(backend) + 1
        return backend

    @property
    def available(self) -> bool:
        """Whether some backend can take a request now."""
        return any(why_out(backend) is None for backend in self.backends)

    def mark_down(self, backend: Backend, cause: str) -> None:
        """A request could not connect to ``backend``: down for new requests until a poll answers, and
        polled now (its streams end if the poll cannot reach it either)."""
        self._mark_down(backend, cause)
        self.recheck(backend)

    def recheck(self, backend: Backend) -> None:
        """Poll ``backend`` now rather than at its next interval (a request just saw it fail)."""
        backend._wake.set()

    async def _poll_forever(self, backend: Backend) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(backend._wake.wait(), self._interval)
            backend._wake.clear()
            try:
                await self.poll(backend)
            except Exception as exc:  # our bug; the backend must not keep its last state for ever
                log.exception("polling %s failed", backend.name)
                self._mark_down(backend, f"the router could not poll it: {type(exc).__name__}: {exc}")

    async def poll(self, backend: Backend) -> None:
        """``GET /health`` of ``backend`` once; record what it says, or why it could not say."""
        try:
            try:
                response = await self._client.get(backend.url + "/health", timeout=self._timeout)
            except _CLOSED_CONNECTION_ERRORS:
                response = await self._client.get(backend.url + "/health", timeout=self._timeout)
            body = response.json()
            if not isinstance(body, dict) or "status" not in body:
                raise ValueError("no status")
        except UNREACHABLE_ERRORS as exc:  # the process or the host is gone: its streams are lost
            self._mark_down(backend, describe_error(exc))
            backend.lost.set()
        except httpx.HTTPError as exc:  # timed out: alive maybe, but unfit for new requests
            self._mark_down(backend, describe_error(exc))
        except ValueError:  # not JSON, or not fd-serve's shape
            self._mark_down(backend, f"GET /health answered {response.status_code} without an fd-serve "
                                     "health body: is this an fd-serve instance?")
        else:
            self._record(backend, body)
        backend.checked_at = time.monotonic()

    def _mark_down(self, backend: Backend, cause: str) -> None:
        if backend.status != DOWN:
            log.warning("backend %s is down: %s", backend.name, cause)
        backend.status, backend.reason, backend.last_error = DOWN, cause, cause
        backend.load = None  # what it reported before is no load any more

    def _record(self, backend: Backend, body: dict[str, Any]) -> None:
        status = body["status"] if isinstance(body["status"], str) and body["status"] in _REPORTED else UNKNOWN
        if status != backend.status and backend.status != UNKNOWN:
            log.info("backend %s: %s -> %s%s", backend.name, backend.status, status,
                     f" ({body.get('reason')})" if body.get("reason") else "")
        if backend.lost.is_set():
            backend.lost = asyncio.Event()  # streams started from now on are not lost
        role = body.get("role", "mixed")  # an fd-serve from before splitwise names no role: it is mixed
        backend.status = status
        backend.role = role if isinstance(role, str) else None
        backend.load = _load(body.get("load"))
        reason = body.get("reason")
        backend.reason = str(reason) if status not in HEALTHY and reason is not None else None


def _load(value: Any) -> dict[str, Any] | None:
    """The reported ``load``, when it has the counts the selection rule adds up (ints); else None."""
    if isinstance(value, dict) and all(isinstance(value.get(key, 0), int) for key in ("running", "waiting")):
        return value
    return None
