"""The exception handlers both HTTP fronts install (fd-serve and the router): every failure is
answered in OpenAI's error shape (:class:`~fd_core.server.http_errors.ApiError`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fd_core.server.http_errors import ApiError

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

log = logging.getLogger(__name__)


def respond(error: ApiError) -> JSONResponse:
    """``error`` as a JSON response with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def install(app: FastAPI, *, internal: Callable[[Exception], ApiError]) -> None:
    """Answer ApiError as itself, Starlette's HTTP errors (404, 405 ...) in the same shape, and
    anything unhandled with ``internal(exc)`` (logged with its traceback)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return respond(exc)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return respond(internal(exc))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
