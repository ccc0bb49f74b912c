"""Contract of the request Scheduler seam: the queue between front ends and the engine loop.

Two sides use it. The *origin* side (the offline LLM, the server's engine process) calls
:meth:`Scheduler.put_request` and :meth:`Scheduler.get_results`; the *engine* side calls
:meth:`Scheduler.get_requests` and :meth:`Scheduler.put_results` from the step loop. Both
sides may run on different threads (or, for cluster schedulers, different hosts), so every
method must be thread-safe.

Invariants:
- Every request put is eventually handed to ``get_requests`` exactly once, or answered with a
  final (``finished=True``) output: expired (TTL) and aborted-while-queued requests get one.
- ``get_results`` returns only outputs of requests this instance put (results are routed back
  to their origin), each output once, in the order they were put per request.
- ``get_requests(timeout=...)`` blocks at most ``timeout`` seconds when nothing is queued;
  it must not spin. :meth:`wake` makes a blocked call return early.
- A request handed out may come with ``output_token_ids`` already filled: a *continuation* of
  one whose earlier holder was lost. Those tokens reached the client already; the engine
  computes their KV and goes on after them (the token processor replays them silently).
- A cluster scheduler may give up a request it handed out (its origin is gone, or it lost the
  lease and another instance serves it): :meth:`take_cancelled` names it, the engine ends it as
  aborted, and its outputs are not routed anywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.contracts.resource_manager import KVStats
    from fd_core.outputs import RequestOutput
    from fd_core.request import Request


class Scheduler(SeamPlugin, ABC):
    """Queues requests for the engine and routes outputs back to their origin."""

    def __init__(self, settings: BaseModel | None, *, hooks: Any, max_queue_size: int) -> None:
        """``hooks`` is the pluggy relay (``fd_order_waiting``); ``max_queue_size`` bounds the queue."""
        self.settings = settings
        self.hooks = hooks
        self.max_queue_size = max_queue_size

    @abstractmethod
    def put_request(self, request: Request) -> None:
        """Queue a request (origin side). Raises QueueFullError when the queue is full."""

    @abstractmethod
    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        """Hand up to ``max_num`` queued requests to the engine, in admission order.

        Blocks up to ``timeout`` seconds (``None``: forever, 0: not at all) while none is queued.
        """

    @abstractmethod
    def put_results(self, outputs: list[RequestOutput]) -> None:
        """Deliver outputs of a step (engine side) to their origins."""

    @abstractmethod
    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        """Outputs for requests this instance put, oldest first; waits up to ``timeout`` for one."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a still-queued request and answer it as aborted; False if it was not queued."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Requests queued and not yet handed to the engine."""

    def take_cancelled(self) -> list[str]:
        """Ids of handed-out requests nobody reads any more, each named once; the engine ends them.

        Called at the start of every step. The default has none.
        """
        return []

    def note_capacity(self, kv: KVStats, free_slots: int) -> None:
        """The resource manager's figures after a step (free KV blocks, requests running and waiting
        for blocks) and the request slots free (``max_num_seqs`` less the requests admitted; with
        fair sharing, :meth:`get_requests` may be asked for more than that). Called by the engine
        loop after every step; must return at once. A scheduler that takes work from elsewhere (the
        pool's work stealing) takes none while the engine could not start it. The default ignores
        it. Added in hookspec version 4.
        """

    def drain(self) -> None:
        """The instance is shutting down (SIGTERM): requests already accepted are still served, but a
        cluster scheduler takes no more work from other instances. Called once, from the engine's
        input thread. The default does nothing. Added in hookspec version 4.
        """

    def stats(self) -> dict[str, Any]:
        """Figures for ``/metrics`` (numbers; a ``degraded_reason`` string marks ``/health`` degraded)."""
        return {}

    def wake(self) -> None:
        """Make a blocked :meth:`get_requests` return now (e.g. an abort or shutdown arrived)."""

    def close(self) -> None:
        """Release connections and threads; called once at shutdown."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """One instance of a prefill/decode deployment, as published in the peer directory."""

    instance_id: str
    role: str             # "prefill" or "decode"
    address: str          # its connector's address (Connector.start)
    connector: str        # its connector's name: only instances with the same connector pair
    host: str             # the host it runs on (boot id), for same-host connectors
    layout: str           # its KV layout (model, layers, heads, block size, dtype): only equal ones pair
    load: int = 0         # prompt tokens it has queued or computing (prefill role)


class PeerDirectory(ABC):
    """A scheduler that also lets prefill and decode instances find each other by load.

    ``splitwise.role = "prefill"`` or ``"decode"`` needs a scheduler with this interface (the
    built-in ``splitwise`` scheduler keeps the directory in Redis); every method is thread-safe
    and must not block the engine loop for long (cache what a remote store answers).
    """

    @abstractmethod
    def join(self, me: PeerInfo) -> None:
        """Publish this instance until :meth:`Scheduler.close`; called once, once it can serve."""

    @abstractmethod
    def report_load(self, load: int) -> None:
        """This instance's current load, published with its next heartbeat."""

    @abstractmethod
    def peers(self, role: str) -> list[PeerInfo]:
        """Live instances of ``role`` (not this one), least loaded first."""
