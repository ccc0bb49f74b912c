"""The front end's asyncio client of the engine process: start it, send requests, route outputs by id.

One :class:`EngineClient` per server. It spawns :func:`run_engine_process`, binds two ipc://
sockets in a private temporary folder, and runs two tasks on the event loop: a sender that
drains an outbox (so that aborts can be queued from synchronous code, even from a cancelled
task) and a reader that routes OUTPUTS to the :class:`RequestStream` owning each request id.

The engine's life is watched through its process sentinel: when it exits unexpectedly it is
reaped, and every pending acknowledgement and every open stream fails with
:class:`EngineDeadError` naming how it ended (exit code, or signal and likely cause) and, during
start-up, the stage it was in; no request hangs (a data-parallel rank's streams are offered to
``rescue`` first, see :mod:`fd_core.server.data_parallel`). Outputs read after that are dropped.
An engine the front end gives up on while its process runs (it cannot read or send) is killed.
``on_dead(reason)`` then tells the server, which exits so that a supervisor restarts it
(docs/server.md).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import zmq
import zmq.asyncio

from fd_core.errors import EngineDeadError, FdError, PluginError, QueueFullError, RequestError
from fd_core.exit_status import describe_exit
from fd_core.server import wire
from fd_core.server.engine_process import run_engine_process

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from fd_core.config import FdConfig
    from fd_core.outputs import RequestOutput
    from fd_core.request import Request

log = logging.getLogger(__name__)

#: How long a stats query waits for the engine's reply, in seconds.
STATS_TIMEOUT_S: Final = 5.0
#: How long shutdown waits for the engine process to exit after SHUTDOWN before killing it.
ENGINE_EXIT_TIMEOUT_S: Final = 10.0
#: How long reaping waits once the sentinel said the process ended (it is a zombie within
#: microseconds; without the wait the exit code could still read None).
REAP_TIMEOUT_S: Final = 5.0


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"          # exited on its own, or failed to start
    STOPPED = "stopped"    # shut down on purpose


class EngineStartError(FdError):
    """The engine process failed to start; the message is its reason."""


class RequestStream:
    """The outputs of one HTTP request's engine requests (several when ``n`` > 1 or several prompts).

    Iterate to get every delta of every request in arrival order; iteration ends after each
    request's final output and raises :class:`EngineDeadError` if the engine dies first.
    :meth:`close` aborts the requests that have not finished. ``delivered`` holds the output
    tokens passed on so far per unfinished request: what a continuation elsewhere starts from.
    """

    def __init__(self, client: EngineClient, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.delivered: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        self._client = client
        self._queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self._unfinished = set(request_ids)   # final output not yet iterated
        self._open = set(request_ids)         # final output not yet arrived

    @property
    def open_ids(self) -> set[str]:
        """Ids whose final output has not arrived yet."""
        return set(self._open)

    def _put(self, item: RequestOutput | EngineDeadError) -> None:
        if not isinstance(item, EngineDeadError):
            self.delivered[item.request_id] += item.new_token_ids
            if item.finished:
                self._open.discard(item.request_id)
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, EngineDeadError):
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Stop routing outputs here and abort what has not finished; safe to call twice."""
        self._client._forget(self)
        if self._unfinished:
            self._client.abort(sorted(self._unfinished))
            self._unfinished.clear()


class EngineClient:
    """Runs the engine process and talks to it; every method runs on the server's event loop."""

    def __init__(self, config: FdConfig, *, log_level: str = "INFO",
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[str], None] | None = None,
                 name: str | None = None, cpus: list[int] | None = None,
                 rescue: Callable[[RequestStream], bool] | None = None) -> None:
        """``name`` prefixes every reason it gives (a data-parallel rank); ``cpus`` pins the
        engine process to those CPUs (None: it runs where the front end may); ``rescue(stream)``
        is offered each open stream when the engine dies while serving, and a stream it takes
        (returns True) is not failed: it continues elsewhere (see :meth:`adopt`), also when its
        requests were not acknowledged yet (:meth:`add` then returns it)."""
        self.config = config
        self.name = name
        self._cpus = cpus
        self._rescue = rescue
        self.state = EngineState.STARTING
        self.dead_reason: str | None = None
        #: What the engine is doing while STARTING (its last STARTING message).
        self.stage = "starting the engine process"
        #: The engine's READY info (see wire.READY: model_name, max_model_len, ..., kernels, warm_up_s).
        self.info: dict[str, Any] = {}
        self._log_level = log_level
        self._on_finished = on_finished
        self._on_dead = on_dead
        self._dir = Path(tempfile.mkdtemp(prefix="fd-serve-"))
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._pull = self._context.socket(zmq.PULL)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._acks: dict[str, asyncio.Future[None]] = {}
        self._stats: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._nonces = itertools.count()
        self._ready: asyncio.Future[None] | None = None
        self._process: BaseProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- life cycle ----------------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn the engine and wait for READY; raises EngineStartError with the engine's reason."""
        loop = asyncio.get_running_loop()
        input_addr, output_addr = f"ipc://{self._dir / 'input'}", f"ipc://{self._dir / 'output'}"
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._push.bind(input_addr)
        self._pull.bind(output_addr)
        self._ready = loop.create_future()
        self._tasks = [asyncio.create_task(self._send_loop(), name="fd-engine-sender"),
                       asyncio.create_task(self._read_loop(), name="fd-engine-reader")]
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(self.config, input_addr, output_addr, self._log_level, self._cpus),
            name="fd-engine")
        process.start()
        self._process = process
        loop.add_reader(process.sentinel, self._on_process_exit)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError:
            self._give_up(f"the engine did not start within {timeout:g} s (server.engine_start_timeout_s)")
            raise EngineStartError(self.dead_reason or "") from None
        except EngineDeadError as exc:
            raise EngineStartError(str(exc)) from None

    async def shutdown(self) -> None:
        """Stop the engine process (SHUTDOWN, then kill if it lingers) and release the sockets."""
        process = self._process
        if process is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(process.sentinel)
            if process.is_alive() and self.state is EngineState.READY:
                await self._push.send(wire.pack([wire.SHUTDOWN]))
                await loop.run_in_executor(None, process.join, ENGINE_EXIT_TIMEOUT_S)
            if process.is_alive():  # still loading, or stuck
                log.warning("stopping the engine process by force")
                process.kill()
                await loop.run_in_executor(None, process.join)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._fail_pending(EngineDeadError("the server is shutting down"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._push.close()
        self._pull.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- requests ------------------------------------------------------------------------------

    async def add(self, requests: list[Request]) -> RequestStream:
        """Queue ``requests`` in the engine as one stream; all are accepted or none is.

        Raises RequestError (invalid; names the field), QueueFullError or EngineDeadError.
        """
        self._check_alive()
        ids = [r.request_id for r in requests]
        in_use = next((i for i in ids if i in self._streams or ids.count(i) > 1), None)
        if in_use is not None:  # registering it would steal the live stream's outputs
            raise RequestError("request_id", f"request id {in_use!r} is already in use by a live request")
        loop = asyncio.get_running_loop()
        packed = [wire.pack(wire.encode_request(r)) for r in requests]  # fails before anything is registered
        stream = RequestStream(self, [r.request_id for r in requests])
        acks = []
        for request, data in zip(requests, packed, strict=True):
            self._streams[request.request_id] = stream
            self._acks[request.request_id] = ack = loop.create_future()
            acks.append(ack)
            self._outbox.put_nowait(data)
        try:
            results = await asyncio.gather(*acks, return_exceptions=True)
        except BaseException:  # cancelled (client gone): undo the registration, abort what was queued
            stream.close()
            raise
        finally:
            for request in requests:
                self._acks.pop(request.request_id, None)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            stream.close()
            raise errors[0]
        return stream

    def adopt(self, stream: RequestStream, requests: list[Request], on_refused: Callable[[], None]) -> None:
        """Continue another engine's ``stream`` here with ``requests`` (continuations of its
        unfinished ones); a refusal fails the stream with the reason, then calls ``on_refused()``.
        Never blocks."""
        self._check_alive()
        stream._client = self
        loop = asyncio.get_running_loop()
        acks = []
        for request in requests:
            self._streams[request.request_id] = stream
            self._acks[request.request_id] = ack = loop.create_future()
            acks.append(ack)
            self._outbox.put_nowait(wire.pack(wire.encode_request(request)))

        async def settle() -> None:
            results = await asyncio.gather(*acks, return_exceptions=True)
            for request in requests:
                self._acks.pop(request.request_id, None)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is not None:
                stream._put(EngineDeadError(f"{self.name or 'the engine'} could not take the request over: {error}"))
                stream.close()
                on_refused()

        self._tasks.append(asyncio.create_task(settle(), name="fd-adopt"))

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (their outputs are dropped); callable from synchronous code."""
        if request_ids and self.state is EngineState.READY:
            self._send([wire.ABORT, request_ids])

    def drain(self) -> None:
        """The server is shutting down: the engine serves what it accepted and takes no more work from
        other instances (a pool); callable from synchronous code."""
        if self.state is EngineState.READY:
            self._send([wire.DRAIN])

    async def stats(self) -> dict[str, Any]:
        """The engine's EngineStats as a dict (``kv`` nested); raises EngineDeadError or TimeoutError."""
        self._check_alive()
        nonce = next(self._nonces)
        self._stats[nonce] = future = asyncio.get_running_loop().create_future()
        self._send([wire.STATS, nonce])
        try:
            return await asyncio.wait_for(future, STATS_TIMEOUT_S)
        finally:
            self._stats.pop(nonce, None)

    # --- internals -----------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.state is EngineState.STARTING:
            raise EngineDeadError("the engine is starting; retry shortly")
        if self.state is not EngineState.READY:
            raise EngineDeadError(self.dead_reason or "the engine is stopped")

    def _send(self, message: list[Any]) -> None:
        self._outbox.put_nowait(wire.pack(message))

    def _forget(self, stream: RequestStream) -> None:
        for request_id in stream.request_ids:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    async def _send_loop(self) -> None:
        try:
            while True:
                await self._push.send(await self._outbox.get())
        except Exception as exc:  # nothing reaches the engine any more: say so instead of hanging
            log.exception("the engine sender failed")
            self._give_up(f"the front end cannot send to the engine any more ({type(exc).__name__}: {exc})")

    async def _read_loop(self) -> None:
        try:
            while True:
                self._handle(wire.unpack(await self._pull.recv()))
        except Exception as exc:  # streams would hang while /health said ok: mark the engine dead
            log.exception("the engine reader failed")
            self._give_up(f"the front end stopped reading the engine's outputs ({type(exc).__name__}: {exc})")

    def _handle(self, message: list[Any]) -> None:
        """Act on one message from the engine process."""
        kind = message[0]
        if kind == wire.OUTPUTS:
            self._route(message[1])
        elif kind == wire.ACK:
            self._resolve(message[1], None)
        elif kind == wire.REJECT:
            _, request_id, reject_kind, field, text = message
            self._resolve(request_id, _reject_error(reject_kind, field, text))
        elif kind == wire.STATS_REPLY:
            future = self._stats.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == wire.STARTING:
            self.stage = message[1]
            log.info("engine start-up: %s", self.stage)
        elif kind == wire.READY:
            self.info = message[1]
            self.state = EngineState.READY
            log.info("engine ready: %s", self.info)
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif kind == wire.FAILED:
            self._die(f"the engine failed to start: {message[1]}")
        else:
            log.error("ignoring an engine message of unknown kind %r", kind)

    def _route(self, items: list[list[Any]]) -> None:
        if self.state is EngineState.DEAD:
            return  # read after the death: its streams already failed, or go on elsewhere from what was delivered
        for item in items:
            output = wire.decode_output(item)
            if output.finished and self._on_finished is not None:
                self._on_finished(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted or closed: nobody waits for it
            if output.finished:
                del self._streams[output.request_id]
            stream._put(output)

    def _resolve(self, request_id: str, error: Exception | None) -> None:
        future = self._acks.get(request_id)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _on_process_exit(self) -> None:
        process = self._process
        assert process is not None
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(REAP_TIMEOUT_S)
        if self.state is EngineState.DEAD:
            return
        how = describe_exit(process.exitcode)
        if self.state is EngineState.STARTING:
            self._die(f"the engine process died during start-up ({self.stage}): {how}")
        else:
            self._die(f"the engine process died: {how}")

    def _give_up(self, reason: str) -> None:
        """The engine is dead to the front end though its process may still run: kill that, so that
        it does not hold its memory and compute requests that continue elsewhere (data parallel)."""
        self._die(reason)
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def _die(self, reason: str) -> None:
        if self.state is EngineState.DEAD:
            return
        if self.name:
            reason = f"{self.name}: {reason}"
        was_serving = self.state is EngineState.READY
        log.error("%s", reason)
        self.state = EngineState.DEAD
        self.dead_reason = reason
        self._fail_pending(EngineDeadError(reason))
        if was_serving and self._on_dead is not None:
            self._on_dead(reason)

    def _fail_pending(self, error: EngineDeadError) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # start() may have stopped waiting; mark it retrieved
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            if self.state is EngineState.DEAD and self._rescue is not None and self._rescue(stream):
                for request_id in stream.request_ids:  # taken over elsewhere: nothing to refuse
                    self._resolve(request_id, None)
            else:
                stream._put(error)
        for future in [*self._acks.values(), *self._stats.values()]:
            if not future.done():
                future.set_exception(error)


def _reject_error(kind: str, field: str | None, text: str) -> FdError:
    """The exception a REJECT stands for (400, 429 or 500 at the HTTP layer)."""
    if kind == wire.QUEUE_FULL:
        return QueueFullError(text)
    if kind == wire.INTERNAL:
        return PluginError(field or "?", text)
    return RequestError(field or "", text)
