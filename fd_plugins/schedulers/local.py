"""The ``local`` request scheduler: an in-process, bounded, thread-safe queue with TTL and abort.

Admission order is FIFO with fair shares for sibling requests, unless a plugin implements
``fd_order_waiting``: the ``n`` choices of one client call share a ``Request.group_id``, and
groups take turns (one request of each group in order of arrival, then the next round), so a
call with ``n=128`` does not hold everyone behind it until all its choices are admitted.
Requests older than ``ttl_s`` when the engine asks for work are answered with an error output
instead of run; they never reached the engine, so the scheduler itself answers them (as it does
an abort while queued). Results are kept per origin in arrival order; every origin here is this
process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fd_core.compat import LOADS_UNTIL, warn_deprecated
from fd_core.contracts.scheduler import Scheduler
from fd_core.errors import QueueFullError
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import RequestOutput
from fd_core.plugin_guard import GuardedHooks
from fd_core.request import FinishReason

if TYPE_CHECKING:
    from fd_core.request import Request


class LocalSchedulerSettings(BaseModel):
    """``[scheduler.options]`` of the local scheduler."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(600.0, gt=0, description="Queued requests older than this expire.")


class LocalScheduler(Scheduler):
    """In-process FIFO queue (order hookable) with a size limit and TTL."""

    name: ClassVar[str] = "local"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = LocalSchedulerSettings
    #: The config key that sets ``max_queue_size``, named by the queue-full error; a subclass
    #: that bounds its queue by a setting of its own names that key here.
    queue_limit_key: ClassVar[str] = "server.max_queue_size"

    def __init__(self, settings: LocalSchedulerSettings | None, *, hooks: Any, max_queue_size: int) -> None:
        super().__init__(settings or LocalSchedulerSettings(), hooks=hooks, max_queue_size=max_queue_size)
        self._waiting: list[Request] = []            # arrival order; reordered by the hook on read
        self._results: deque[RequestOutput] = deque()
        self._lock = threading.Lock()
        self._has_requests = threading.Condition(self._lock)
        self._has_results = threading.Condition(self._lock)
        self._woken = False
        self._decisions = GuardedHooks(hooks)

    def put_request(self, request: Request) -> None:
        with self._lock:
            if len(self._waiting) >= self.max_queue_size:
                raise QueueFullError(f"request queue is full: {len(self._waiting)} waiting, the most "
                                     f"{self.queue_limit_key} ({self.max_queue_size}) allows; retry, or raise it")
            self._waiting.append(request)
            self._has_requests.notify()

    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        with self._lock:
            if not self._waiting and timeout != 0 and not self._woken:
                self._has_requests.wait(timeout)
            self._woken = False
            self._expire(time.time())
            if not self._waiting or max_num <= 0:
                return []
            self._waiting = self.admission_order(list(self._waiting), time.time())
            taken, self._waiting = self._waiting[:max_num], self._waiting[max_num:]
            return taken

    def put_results(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._lock:
            self._results.extend(outputs)
            self._has_results.notify_all()

    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        with self._lock:
            return drain_results(self._results, self._has_results, timeout)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            for index, request in enumerate(self._waiting):
                if request.request_id == request_id:
                    del self._waiting[index]
                    self._answer(request, FinishReason.ABORT, None)
                    return True
            return False

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def wake(self) -> None:
        with self._lock:
            self._woken = True
            self._has_requests.notify_all()
            self._has_results.notify_all()

    def admission_order(self, waiting: list[Request], now: float) -> list[Request]:
        """Order of admission: the ``fd_order_waiting`` hooks' answer, else :meth:`default_order`.

        Runs with the queue lock held. Hooks take precedence over a subclass's default (a
        subclass overrides :meth:`default_order`; overriding this method is refused when the
        class is defined, since it would silently bypass every hook). A hook that raises or
        answers anything but a permutation is reported once and the default is used (see
        :class:`~fd_core.plugin_guard.GuardedHooks`).
        """

        ordered = hook_order(self._decisions, waiting, now)
        return self.default_order(waiting, now) if ordered is None else ordered

    def default_order(self, waiting: list[Request], now: float) -> list[Request]:
        """The order when no hook answers: :func:`fair_fifo`. Subclasses may override it; it must
        return a permutation of ``waiting`` (it runs with the queue lock held)."""
        return fair_fifo(waiting)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Mend or refuse the two ways a subclass used to break this class silently.

        A subclass overriding :meth:`admission_order` (as the docs of hookspec version 1 showed)
        bypassed every ``fd_order_waiting`` hook. Until fd-engine 0.4.0 its override is taken as
        its :meth:`default_order` (hooks answer first, then its order), with a deprecation
        warning; a class that overrides both is refused: there is no telling which it meant.
        """
        super().__init_subclass__(**kwargs)
        if "admission_order" in cls.__dict__:
            where = f"{cls.__module__}.{cls.__qualname__}"
            if "default_order" in cls.__dict__:
                raise TypeError(f"{where} overrides both admission_order and default_order; admission_order "
                                "would bypass every fd_order_waiting hook: keep default_order only")
            cls.default_order = cls.__dict__["admission_order"]  # type: ignore[method-assign]
            delattr(cls, "admission_order")
            warn_deprecated(f"scheduler class {where}", (
                f"overrides admission_order, which bypassed every fd_order_waiting hook; it is used as "
                f"default_order until fd-engine {LOADS_UNTIL} (hooks answer first): rename the method to "
                "default_order"))
        model = cls.__dict__.get("settings_model")
        if model is not None and not issubclass(model, LocalSchedulerSettings):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.settings_model must subclass "
                            f"LocalSchedulerSettings (this class reads its ttl_s)")

    def _expire(self, now: float) -> None:
        """Answer queued requests older than the TTL (lock held)."""
        ttl = self.settings.ttl_s
        kept = []
        for request in self._waiting:
            if now - request.arrival_time > ttl:
                self._answer(request, FinishReason.ERROR, f"request expired after waiting {ttl:g} s in the queue")
            else:
                kept.append(request)
        self._waiting = kept

    def _answer(self, request: Request, reason: FinishReason, error: str | None) -> None:
        """Answer a request that never reached the engine (lock held)."""
        self._results.append(RequestOutput(
            request_id=request.request_id, finished=True, finish_reason=reason, error=error,
            num_prompt_tokens=request.num_prompt_tokens))
        self._has_results.notify_all()


def drain_results(results: deque[RequestOutput], has_results: threading.Condition,
                  timeout: float | None) -> list[RequestOutput]:
    """Every queued output, oldest first, waiting up to ``timeout`` for one (``has_results``' lock held)."""
    if not results and timeout != 0:
        has_results.wait(timeout)
    taken = list(results)
    results.clear()
    return taken


def hook_order(decisions: GuardedHooks, waiting: list[Request], now: float) -> list[Request] | None:
    """The ``fd_order_waiting`` hooks' order of ``waiting``, or None when no hook answers with a
    permutation of it (a wrong answer is reported once, naming the plugin)."""

    def is_permutation(answer: Any) -> str | None:
        try:
            same = sorted(map(id, answer)) == sorted(map(id, waiting))
        except TypeError:
            same = False
        return None if same else "is not a permutation of the waiting requests"

    ordered = decisions.decide("fd_order_waiting", is_permutation, waiting=list(waiting), now=now)
    return None if ordered is None else list(ordered)


def fair_fifo(waiting: list[Request]) -> list[Request]:
    """Arrival order, with sibling requests (same ``group_id``) taking turns with other calls.

    Round ``k`` holds the ``k``-th request of every group, groups in order of their first
    arrival; a request without a group is a group of one. ``[A0, A1, A2, B0, C0]`` becomes
    ``[A0, B0, C0, A1, A2]``.
    """
    groups: dict[object, list[Request]] = {}
    for request in waiting:
        groups.setdefault(request.group_id if request.group_id is not None else id(request), []).append(request)
    if len(groups) == len(waiting):
        return waiting
    rounds: list[Request] = []
    depth = max(len(members) for members in groups.values())
    for k in range(depth):
        rounds.extend(members[k] for members in groups.values() if k < len(members))
    return rounds
