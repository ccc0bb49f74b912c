"""The router's HTTP endpoints: the two generation routes, models, health and metrics.

Generation requests and ``/v1/models`` are forwarded (:mod:`fd_core.router.forward`);
``/health`` and ``/metrics`` are the router's own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fd_core.router.errors import body_too_slow
from fd_core.router.metrics import CONTENT_TYPE
from fd_core.server.body import read_body

if TYPE_CHECKING:
    from fd_core.router.app import RouterState
    from fd_core.router.config import RouterSection

router = APIRouter()


def _state(request: Request) -> RouterState:
    return request.app.state.fd_router


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 ``ok`` while some backend can take requests, else 503 ``unavailable``; both list every backend."""
    pool = _state(request).pool
    available = pool.available
    body: dict[str, Any] = {"status": "ok" if available else "unavailable",
                            "backends": [backend.public() for backend in pool.backends]}
    return JSONResponse(body, status_code=200 if available else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return await _state(request).forwarder.forward(request, "GET", "/v1/models", None)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, "/v1/completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "/v1/chat/completions")


async def _generate(request: Request, path: str) -> Response:
    state = _state(request)
    body = await _read_body(request, state.settings)
    return await state.forwarder.generate(request, path, body)


async def _read_body(request: Request, settings: RouterSection) -> bytes:
    """The body, at most ``router.max_body_bytes`` (413) within ``router.body_timeout_s`` (408); read
    before the request takes a concurrency slot, so that a slow client holds none."""
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            return await read_body(request, settings.max_body_bytes, limit_key="router.max_body_bytes")
    except TimeoutError:
        raise body_too_slow(settings.body_timeout_s) from None
