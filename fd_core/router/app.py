"""Assemble the router's FastAPI application: its shared state, the pool's polling, error handlers.

The pool polls every backend once before the first request is accepted (so that the first
requests find the healthy ones), then keeps polling until shutdown, when the shared HTTP client
is closed. Every error leaves as OpenAI's error body, unknown routes included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import httpx
from fastapi import FastAPI

from fd_core.router.backends import BackendPool
from fd_core.router.forward import Forwarder
from fd_core.router.metrics import RouterMetrics
from fd_core.router.routes import router
from fd_core.server import error_handlers
from fd_core.server.connections import HeadLimit
from fd_core.server.http_errors import ApiError

if TYPE_CHECKING:
    from fd_core.router.config import RouterConfig, RouterSection

#: Seconds an idle connection to a backend is kept for reuse (below uvicorn's keep-alive timeout, 5 s).
KEEPALIVE_EXPIRY_S: Final = 2.0


@dataclass(slots=True, eq=False)
class RouterState:
    """What the routes share (``app.state.fd_router``)."""

    settings: RouterSection
    pool: BackendPool
    forwarder: Forwarder
    metrics: RouterMetrics


def create_app(config: RouterConfig) -> FastAPI:
    """The router application for ``config``."""
    settings = config.router
    # No connection limit: router.max_concurrency bounds the requests. Idle connections are dropped
    # after KEEPALIVE_EXPIRY_S, before fd-serve (uvicorn: 5 s) closes them: a request sent on a
    # connection the backend is closing would fail as if the backend had died. trust_env=False:
    # a proxy from the environment (HTTP_PROXY) must not sit between the router and its backends.
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=KEEPALIVE_EXPIRY_S),
                               trust_env=False, follow_redirects=False)
    pool = BackendPool(settings, client)
    metrics = RouterMetrics(pool)
    state = RouterState(settings=settings, pool=pool, forwarder=Forwarder(settings, pool, client, metrics),
                        metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()
            await client.aclose()

    app = FastAPI(title="fd-engine router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fd_router = state
    app.add_middleware(HeadLimit, limit=settings.max_header_bytes, limit_key="router.max_header_bytes")
    app.include_router(router)
    error_handlers.install(app, internal=_internal_error)
    return app


def _internal_error(exc: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
