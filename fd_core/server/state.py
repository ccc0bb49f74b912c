"""What the routes of one server share: engine client, tokenizer, limits, metrics and admission.

Admission control: every generation request holds one of ``server.max_concurrency`` slots
from before it is queued until its response ends (the stream's last event included); a request
that finds them all taken gets 429. During start-up, after the engine died, and once SIGTERM
started the drain, new requests get 503.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.server.engine_client import EngineState
from fd_core.server.http_errors import ApiError

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.server.engine_client import EngineClient
    from fd_core.server.metrics import ServerMetrics
    from fd_core.server.prepare import Limits


@dataclass(slots=True, eq=False)
class ServerState:
    config: FdConfig
    model_name: str           # the name clients use (model.served_name or model.source)
    client: EngineClient
    metrics: ServerMetrics
    tokenizer: Any = None     # set once loaded (the engine may still be starting)
    limits: Limits | None = None
    draining: bool = False    # SIGTERM received: finish what is in flight, accept nothing new
    in_flight: int = 0        # generation requests holding a slot

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
            raise ApiError(503, f"service unavailable ({status}): {reason}", type="service_unavailable_error",
                           code=f"engine_{status}")

    def admit(self) -> None:
        """Take a concurrency slot or raise 429."""
        limit = self.config.server.max_concurrency
        if self.in_flight >= limit:
            raise ApiError(429, f"too many requests in flight ({limit}, server.max_concurrency); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded")
        self.in_flight += 1
        self.metrics.http_in_flight.inc()

    def release(self) -> None:
        assert self.in_flight > 0, "released a concurrency slot that was not taken"
        self.in_flight -= 1
        self.metrics.http_in_flight.dec()
