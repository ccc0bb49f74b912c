"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own.

    fd_router_backend_up{backend,role}        1 while the backend's last /health said ok or degraded
    fd_router_backend_in_flight{backend}      requests the router has sent it and not finished
    fd_router_backend_load{backend}           the load the selection rule compares (fd_core.router.choose.score)
    fd_router_requests_total{backend,outcome} attempts, by how they ended (see OUTCOMES)
    fd_router_no_backend_total                requests answered 503 no_backend

The per-backend gauges are read from the pool when scraped, so they never go stale.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fd_core.router.choose import score

if TYPE_CHECKING:
    from fd_core.router.backends import BackendPool

#: Content type of the exposition format.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

#: How an attempt to have a backend answer a request ended (label ``outcome``).
OK: Final = "ok"                        # the backend answered 2xx, streamed to the end where streaming
ERROR_STATUS: Final = "error_status"    # the backend answered with its own error (4xx/5xx), passed through
UNREACHABLE: Final = "unreachable"      # could not connect; the request went to the next backend
BACKEND_ERROR: Final = "backend_error"  # failed or timed out after connecting (502, or an error event)
CLIENT_GONE: Final = "client_gone"      # the client left first; the upstream request was closed
OUTCOMES: Final = (OK, ERROR_STATUS, UNREACHABLE, BACKEND_ERROR, CLIENT_GONE)


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("fd_router_backend_up", "1 while the backend's last /health said ok or degraded.",
                               labels=["backend", "role"])
        in_flight = GaugeMetricFamily("fd_router_backend_in_flight",
                                      "Requests the router has sent the backend and not finished.", labels=["backend"])
        load = GaugeMetricFamily("fd_router_backend_load", "In flight from the router + reported waiting + running.",
                                 labels=["backend"])
        for backend in self._pool.backends:
            up.add_metric([backend.name, backend.role or "unknown"], int(backend.healthy))
            in_flight.add_metric([backend.name], backend.in_flight)
            load.add_metric([backend.name], score(backend))
        yield from (up, in_flight, load)


class RouterMetrics:
    """The router's registry: :meth:`attempt` per forwarding attempt, :meth:`render` on scrape."""

    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        self.requests = Counter("fd_router_requests", "Forwarding attempts, by backend and outcome.",
                                ["backend", "outcome"], registry=self.registry)
        self.no_backend = Counter("fd_router_no_backend", "Requests answered 503 because no backend could take them.",
                                  registry=self.registry)
        for backend in pool.backends:  # every series exists from the start (rate() needs its zero)
            for outcome in OUTCOMES:
                self.requests.labels(backend=backend.name, outcome=outcome)

    def attempt(self, backend_url: str, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(backend=backend_url, outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
