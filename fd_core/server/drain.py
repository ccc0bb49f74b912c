"""Fail the requests still in flight when the SIGTERM drain's ``server.shutdown_timeout_s`` runs out.

uvicorn's own graceful-shutdown timeout cancels the request tasks, which leaves a non-streaming
client with ``500 text/plain`` and cuts streams short. Instead, every wait of a generation
request (reading its body, preparing it, the engine's acknowledgement, each next output) runs
inside :meth:`Drain.scope`; :meth:`Drain.start` gives all of them a deadline, and a wait that
reaches it raises a 503 :class:`ApiError` (``code`` :data:`SHUTTING_DOWN`) where the request
is, so that it is answered in the documented error shape: a JSON error body, or an error event
and ``[DONE]`` on a stream. uvicorn's timeout is set a few seconds later as a backstop
(:mod:`fd_core.server.main`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeVar

from fd_core.server.http_errors import SHUTTING_DOWN, unavailable

if TYPE_CHECKING:
    from types import TracebackType

    from fd_core.server.http_errors import ApiError

T = TypeVar("T")


class Drain:
    """The shutdown deadline of the requests in flight (none until :meth:`start`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s          # server.shutdown_timeout_s
        self.deadline: float | None = None  # event-loop time at which waits fail; None: no drain yet
        self._scopes: set[_Scope] = set()   # the scopes being waited in now

    def start(self) -> None:
        """Begin the countdown (on the event loop, when the server starts shutting down)."""
        if self.deadline is not None:
            return
        self.deadline = asyncio.get_running_loop().time() + self.timeout_s
        for scope in self._scopes:
            scope.arm(self.deadline)

    def scope(self) -> _Scope:
        """``async with drain.scope():`` raises the 503 if the deadline passes while inside."""
        return _Scope(self)

    async def iterate(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """``items``, each awaited inside a scope (the time spent sending them is not a wait)."""
        iterator = aiter(items)
        while True:
            async with self.scope():
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    return
            yield item

    def error(self) -> ApiError:
        """The 503 of a request the deadline caught."""
        return unavailable(
            f"the server is shutting down and server.shutdown_timeout_s ({self.timeout_s:g} s) ran out "
            "before this request finished; send it again (to another instance)", SHUTTING_DOWN)


class _Scope:
    """One wait of one request: at the deadline its task is cancelled, and the cancellation
    leaves the scope as :meth:`Drain.error` (asyncio.timeout, which does this, needs Python 3.11)."""

    __slots__ = ("_drain", "_task", "_timer", "_fired")

    def __init__(self, drain: Drain) -> None:
        self._drain = drain
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def __aenter__(self) -> None:
        drain = self._drain
        # Past the deadline, fail at once: a wait that does not suspend (its item is ready) would
        # never be cancelled, and a stream whose outputs keep coming would run to its end.
        if drain.deadline is not None and asyncio.get_running_loop().time() >= drain.deadline:
            raise drain.error()
        self._task = asyncio.current_task()
        drain._scopes.add(self)
        if drain.deadline is not None:
            self.arm(drain.deadline)

    def arm(self, deadline: float) -> None:
        self._timer = asyncio.get_running_loop().call_at(deadline, self._fire)

    def _fire(self) -> None:
        assert self._task is not None, "armed before it was entered"
        self._fired = True
        self._task.cancel()  # lands in the awaited call inside the scope: the task is not running now

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._drain._scopes.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._fired and exc_type is asyncio.CancelledError:
            assert self._task is not None
            if sys.version_info >= (3, 11):
                self._task.uncancel()  # this cancellation is handled here, not by whoever awaits the task
            raise self._drain.error() from None
