"""What the routes of one server share: engine client, tokenizer, limits, metrics, admission and workers.

Admission control: every generation request holds one of ``server.max_concurrency`` slots
from before its body is read until its response ends (the stream's last event included); a
request that finds them all taken gets 429. So at most that many bodies (each at most
``server.max_body_bytes``) are held at once. During start-up, after the engine died, and once
SIGTERM started the drain, new requests get 503.

Parsing, chat templating and tokenising run on :data:`PREPARE_THREADS` worker threads
(:meth:`ServerState.run_blocking`), never on the event loop, so that ``/health`` and streams
stay responsive while a large body is prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

from fd_core.server.engine_client import EngineState
from fd_core.server.http_errors import ENGINE_DEAD, ENGINE_STARTING, SHUTTING_DOWN, too_many_requests, unavailable

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.server.data_parallel import DataParallelClient
    from fd_core.server.drain import Drain
    from fd_core.server.engine_client import EngineClient
    from fd_core.server.metrics import ServerMetrics
    from fd_core.server.prepare import Limits

T = TypeVar("T")

#: Worker threads that prepare requests. JSON parsing and templating hold the GIL (tokenising
#: releases it), so more threads would not prepare faster; two keep one large request from
#: delaying every other.
PREPARE_THREADS: Final = 2

#: The 503 ``code`` of each /health status other than ok.
_UNAVAILABLE_CODES: Final = {"starting": ENGINE_STARTING, "dead": ENGINE_DEAD, "draining": SHUTTING_DOWN}


@dataclass(slots=True, eq=False)
class ServerState:
    config: FdConfig
    model_name: str           # the name clients use (model.served_name or model.source)
    client: EngineClient | DataParallelClient
    metrics: ServerMetrics
    drain: Drain              # fails what is still in flight once server.shutdown_timeout_s ran out
    tokenizer: Any = None     # set once loaded (the engine may still be starting)
    tool_parser: Any = None   # ToolParser reading this model's tool calls, or None (set with the tokenizer)
    reasoning_parser: Any = None   # ReasoningParser splitting its thinking off, or None
    limits: Limits | None = None
    draining: bool = False    # SIGTERM received: finish what is in flight, accept nothing new
    in_flight: int = 0        # generation requests holding a slot
    workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="fd-prepare"))

    @property
    def ready(self) -> bool:
        return self.client.state is EngineState.READY and self.tokenizer is not None and self.limits is not None

    def status(self) -> tuple[str, str | None]:
        """``(status, reason)`` for /health: ok, starting, draining or dead."""
        if self.draining:
            return "draining", "the server is shutting down"
        state = self.client.state
        if state is EngineState.DEAD:
            return "dead", self.client.dead_reason
        if state is EngineState.STOPPED:
            return "dead", "the engine is stopped"
        if state is EngineState.STARTING:
            return "starting", f"the engine is starting: {self.client.stage}"
        if not self.ready:
            return "starting", "the front end is loading the tokenizer"
        return "ok", None

    def check_serving(self) -> None:
        """Raise 503 unless new generation requests can be served."""
        status, reason = self.status()
        if status != "ok":
            raise unavailable(f"service unavailable ({status}): {reason}", _UNAVAILABLE_CODES[status])

    def admit(self) -> None:
        """Take a concurrency slot or raise 429."""
        limit = self.config.server.max_concurrency
        if self.in_flight >= limit:
            raise too_many_requests(f"too many requests: {self.in_flight} in flight, the most server.max_concurrency "
                                    f"({limit}) allows; retry later")
        self.in_flight += 1
        self.metrics.http_in_flight.inc()

    def release(self) -> None:
        assert self.in_flight > 0, "released a concurrency slot that was not taken"
        self.in_flight -= 1
        self.metrics.http_in_flight.dec()

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread (for work that would stall the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
