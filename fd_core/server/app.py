"""Assemble the FastAPI application: shared state, start-up and shutdown of the engine, error handlers.

The HTTP server answers as soon as it is bound; the engine process and the front end's
tokenizer load in the background (``/health`` is 503 "starting" until both are ready). A
start-up failure is reported through ``on_fatal`` with ``ExitCode.FAILED``, which stops
the server with an error. An engine process that dies while serving is reported the same way
with ``ExitCode.ENGINE_DIED``, ``server.exit_after_engine_death_s`` later (requests in flight
have been answered with the cause by then).
Every error leaves as OpenAI's error body, including FastAPI's own validation errors (400,
not 422) and unknown routes; a 429 also carries ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from fd_core.errors import FdError
from fd_core.exit_codes import ExitCode
from fd_core.server import error_handlers
from fd_core.server.connections import CloseWhileDraining, HeadLimit
from fd_core.server.data_parallel import DataParallelClient
from fd_core.server.drain import Drain
from fd_core.server.engine_client import EngineClient
from fd_core.server.http_errors import from_exception, from_validation_errors
from fd_core.server.metrics import ServerMetrics
from fd_core.server.prepare import Limits
from fd_core.server.rank_placement import resolve_data_parallel_size
from fd_core.server.routes import router
from fd_core.server.state import ServerState

if TYPE_CHECKING:
    from fd_core.config import FdConfig

log = logging.getLogger(__name__)


def create_app(config: FdConfig, *, on_fatal: Callable[[str, int], None], log_level: str = "INFO") -> FastAPI:
    """The application for ``config``; ``on_fatal(message, exit_code)`` stops the server."""

    def on_engine_death(reason: str) -> None:
        asyncio.get_running_loop().call_later(config.server.exit_after_engine_death_s, on_fatal,
                                              f"{reason}; exiting so that a supervisor restarts fd-serve",
                                              ExitCode.ENGINE_DIED)

    config = resolve_data_parallel_size(config)
    metrics = ServerMetrics()
    client_type = DataParallelClient if config.parallel.data_parallel_size != 1 else EngineClient
    client = client_type(config, log_level=log_level, on_finished=metrics.observe, on_dead=on_engine_death)
    state = ServerState(config=config, model_name=config.model.served_name or config.model.source,
                        client=client, metrics=metrics, drain=Drain(config.server.shutdown_timeout_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = asyncio.create_task(_start(state, on_fatal), name="fd-start")
        try:
            yield
        finally:
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            await client.shutdown()
            state.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="fd-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fd = state
    app.add_middleware(HeadLimit, limit=config.server.max_header_bytes, limit_key="server.max_header_bytes")
    app.add_middleware(CloseWhileDraining, draining=lambda: state.draining)
    app.include_router(router)
    error_handlers.install(app, internal=from_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(FdError, _fd_error)
    return app


async def _start(state: ServerState, on_fatal: Callable[[str, int], None]) -> None:
    """Fetch the model if it is an alias, then start the engine and load the tokenizer side by side."""
    from fd_core.model.default_model import MODEL_ALIASES, resolve_alias
    from fd_core.model.loader import load_tokenizer

    loop = asyncio.get_running_loop()
    source = state.config.model.source
    try:
        if source in MODEL_ALIASES:  # download once here rather than in both processes at once
            await loop.run_in_executor(None, resolve_alias, source)
        # gather: when one fails, the other's later failure is marked retrieved (no stray traceback)
        _, tokenizer = await asyncio.gather(state.client.start(timeout=state.config.server.engine_start_timeout_s),
                                            loop.run_in_executor(None, load_tokenizer, source))
        limits = await loop.run_in_executor(None, Limits.from_info, state.client.info, tokenizer)
        state.tool_parser, state.reasoning_parser = await loop.run_in_executor(None, _parsers, state.config,
                                                                               tokenizer.chat_template)
        state.tokenizer = tokenizer
    except FdError as exc:
        on_fatal(str(exc), ExitCode.FAILED)
        return
    except Exception as exc:  # a bug, but the server must not sit there unhealthy forever
        log.exception("start-up failed")
        on_fatal(f"start-up failed: {type(exc).__name__}: {exc}", ExitCode.FAILED)
        return
    state.limits = limits
    log.info("serving %s (max_model_len %d)", state.model_name, state.limits.max_model_len)


def _parsers(config: FdConfig, chat_template: str | None) -> tuple[Any, Any]:
    """The tool and reasoning parsers of this model's replies (``[tool_parser]``, ``[reasoning_parser]``)."""
    from fd_core.parser_choice import choose_parser
    from fd_core.registry import Registry

    registry = Registry.discover(strict=config.plugins.strict, disabled=config.plugins.disabled,
                                 hooks=config.plugins.hooks)
    return (choose_parser(config, registry, "tool_parser", chat_template),
            choose_parser(config, registry, "reasoning_parser", chat_template))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_handlers.respond(from_validation_errors(list(exc.errors())))


async def _fd_error(request: Request, exc: Exception) -> JSONResponse:
    return error_handlers.respond(from_exception(exc))
