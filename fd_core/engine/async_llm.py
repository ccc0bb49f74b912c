"""The asyncio engine client: streaming ``generate`` and ``abort`` over an in-process EngineCore.

Two threads serve it: the engine loop (:meth:`EngineCore.run`) and a result pump that moves
outputs from the scheduler to the asyncio queue of the request they belong to.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fd_core.errors import RequestError
from fd_core.request import Request, SamplingParams, check_priority

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.engine.core import EngineCore
    from fd_core.engine.llm import ModelArg
    from fd_core.outputs import RequestOutput

#: How often the pump re-checks for shutdown while no output arrives, in seconds.
PUMP_WAKE_S = 0.5


class AsyncLLM:
    """Stream outputs of requests run by a background engine thread.

    Use as ``async with AsyncLLM.start() as llm: async for out in llm.generate(...)``
    (``start`` takes the same arguments as ``LLM``). Leaving a ``generate`` iteration early
    (break, cancellation, client gone) aborts the request.
    """

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._engine_thread = threading.Thread(target=engine.run, args=(self._stop,), name="fd-engine", daemon=True)
        self._pump_thread = threading.Thread(target=self._pump, name="fd-results", daemon=True)
        self._engine_thread.start()
        self._pump_thread.start()

    @classmethod
    def start(cls, model: ModelArg | None = None, *, config: FdConfig | None = None, **sections: Any) -> AsyncLLM:
        """Build the engine (as ``LLM(model, config=..., **sections)`` does) and start its threads."""
        from fd_core.engine.builder import build_engine
        from fd_core.engine.llm import engine_config

        return cls(build_engine(engine_config(model, config, sections)))

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until the final one. Raises RequestError / QueueFullError.

        ``priority`` is ``Request.priority`` (lower runs first under a priority hook plugin).
        """
        try:
            priority = check_priority(priority)
        except ValueError as exc:
            raise RequestError("priority", str(exc)) from exc
        tokenizer = self.engine.tokenizer
        request = Request(
            request_id=request_id or f"async-{next(self._ids)}",
            prompt_token_ids=tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt),
            prompt=prompt if isinstance(prompt, str) else None,
            sampling_params=sampling_params or SamplingParams(),
            eos_token_ids=tuple(tokenizer.eos_token_ids), priority=priority)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:  # taking its place would steal a live stream
                raise RequestError("request_id", f"request id {request.request_id!r} is already in use "
                                   "by a live request")
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(request)
        except BaseException:
            with self._lock:
                self._streams.pop(request.request_id, None)
            raise
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self.engine.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final ``abort`` output."""
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        """Stop both threads (requests still running are abandoned), then close the engine."""
        self._stop.set()
        self.engine.wake()
        self._engine_thread.join()
        self._pump_thread.join()
        self.engine.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def _pump(self) -> None:
        while not self._stop.is_set():
            for output in self.engine.get_results(timeout=PUMP_WAKE_S):
                with self._lock:
                    target = self._streams.get(output.request_id)
                if target is not None:
                    loop, queue = target
                    try:
                        loop.call_soon_threadsafe(queue.put_nowait, output)
                    except RuntimeError:  # that caller's event loop is closed; others go on
                        self.engine.abort(output.request_id)
