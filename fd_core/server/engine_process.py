"""The engine process: build the EngineCore, run its loop, and serve it over two zmq sockets.

Started by :class:`fd_core.server.engine_client.EngineClient` with the ``spawn`` start method.
Three threads share the EngineCore (whose front door is thread-safe):

- the main thread runs :meth:`EngineCore.run` until told to stop;
- the input thread reads ADD / ABORT / STATS / DRAIN / SHUTDOWN messages and answers ADD with ACK or
  REJECT; it also stops everything when the parent process is gone;
- the output thread sends each ``get_results()`` batch as one OUTPUTS message.

Both sender threads use the one output socket under a lock (zmq sockets are not thread-safe).
SIGINT and SIGTERM are ignored here: the front end decides when the engine stops (it drains
in-flight requests first), and kills it only as a last resort. Start-up stages are announced
(STARTING) before they run and ``faulthandler`` is on, so that if a native kernel kills the
process the front end can say in which stage, and the log shows the Python stack that ran it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import threading
import traceback
from typing import TYPE_CHECKING, Any, Final

from fd_core.errors import FdError, PluginError, QueueFullError, RequestError
from fd_core.server import wire

if TYPE_CHECKING:
    from collections.abc import Callable

    import zmq

    from fd_core.config import FdConfig
    from fd_core.engine.core import EngineCore

log = logging.getLogger(__name__)

#: How often the input and output threads re-check for shutdown while idle, in milliseconds.
IDLE_CHECK_MS: Final = 500


def run_engine_process(config: FdConfig, input_addr: str, output_addr: str, log_level: str,
                       cpus: list[int] | None = None) -> None:
    """Process target: build the engine, announce READY (or FAILED) and serve until SHUTDOWN.

    ``cpus``: run on these CPUs only (a data-parallel rank's share), before anything reads
    the CPU count (the cpu platform sizes its thread pools from it).
    """
    import zmq

    if cpus:
        os.sched_setaffinity(0, cpus)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    from fd_core.paddle_import import import_paddle

    import_paddle()  # before faulthandler, whose handler then chains to Paddle's

    faulthandler.enable()
    parent_pid = os.getppid()
    context = zmq.Context()
    output = context.socket(zmq.PUSH)
    output.setsockopt(zmq.LINGER, 2000)
    output.connect(output_addr)
    sender = _Sender(output)
    try:
        engine = _build(config, progress=lambda stage: sender.send([wire.STARTING, stage]))
    except BaseException as exc:
        sender.send([wire.FAILED, _describe(exc)])
        output.close()
        context.term()
        raise SystemExit(1) from None
    input_ = context.socket(zmq.PULL)
    input_.setsockopt(zmq.LINGER, 0)
    input_.connect(input_addr)
    sender.send([wire.READY, {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                              "vocab_size": engine.runner.arch.vocab_size, "num_blocks": engine.limits.num_blocks,
                              "block_size": engine.limits.block_size,
                              "kernels": engine.runner.kernels.describe(),
                              "warm_up_s": engine.runner.warm_up_seconds}])
    stop = threading.Event()
    threads = [
        threading.Thread(target=_input_loop, args=(engine, input_, sender, stop, parent_pid), name="fd-engine-input"),
        threading.Thread(target=_output_loop, args=(engine, sender, stop), name="fd-engine-output"),
    ]
    for thread in threads:
        thread.start()
    try:
        engine.run(stop)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        engine.close()
        input_.close()
        output.close()
        context.term()


def _build(config: FdConfig, progress: Callable[[str], None]) -> EngineCore:
    from fd_core.engine.builder import build_engine

    return build_engine(config, progress=progress)


def _describe(exc: BaseException) -> str:
    """A start-up failure as one message: FdErrors name their cause; anything else is a bug."""
    if isinstance(exc, FdError):
        return str(exc)
    return "".join(traceback.format_exception(exc)).rstrip()


class _Sender:
    """The output socket, shared by the input and output threads."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self._lock = threading.Lock()

    def send(self, message: list[Any]) -> None:
        data = wire.pack(message)
        with self._lock:
            self._socket.send(data)


def _guarded(loop: Any) -> Any:
    """Run a thread loop; if it dies, stop the whole process so the front end sees the engine die."""

    def run(engine: EngineCore, *args: Any) -> None:
        try:
            loop(engine, *args)
        except Exception:
            log.exception("engine thread %s failed; stopping the engine", threading.current_thread().name)
            stop = next(a for a in args if isinstance(a, threading.Event))
            stop.set()
            engine.wake()

    return run


@_guarded
def _input_loop(engine: EngineCore, socket: zmq.Socket[bytes], sender: _Sender, stop: threading.Event,
                parent_pid: int) -> None:
    while not stop.is_set():
        if not socket.poll(IDLE_CHECK_MS):
            if os.getppid() != parent_pid:  # the front end died without saying SHUTDOWN
                log.warning("front end process %d is gone; stopping the engine", parent_pid)
                break
            continue
        message = wire.unpack(socket.recv())
        kind = message[0]
        if kind == wire.ADD:
            _add(engine, message, sender)
        elif kind == wire.ABORT:
            for request_id in message[1]:
                engine.abort(request_id)
        elif kind == wire.STATS:
            sender.send([wire.STATS_REPLY, message[1], dataclasses.asdict(engine.stats())])
        elif kind == wire.SHUTDOWN:
            break
        elif kind == wire.DRAIN:
            engine.drain()
        else:
            log.error("ignoring a message of unknown kind %r", kind)
    stop.set()
    engine.wake()


def _add(engine: EngineCore, message: list[Any], sender: _Sender) -> None:
    """Queue one ADD and answer it: ACK, or REJECT saying why. Never stops the engine."""
    request = wire.decode_request(message)
    try:
        engine.add_request(request)
    except RequestError as exc:
        sender.send([wire.REJECT, request.request_id, wire.INVALID, exc.field, str(exc)])
    except QueueFullError as exc:
        sender.send([wire.REJECT, request.request_id, wire.QUEUE_FULL, None, str(exc)])
    except PluginError as exc:
        log.error("%s", exc)
        sender.send([wire.REJECT, request.request_id, wire.INTERNAL, exc.plugin, exc.reason])
    except Exception as exc:  # our own bug: still only this request fails
        log.exception("could not queue request %r", request)
        sender.send([wire.REJECT, request.request_id, wire.INTERNAL, "fd_core",
                     f"queueing the request failed: {type(exc).__name__}: {exc}"])
    else:
        sender.send([wire.ACK, request.request_id])


@_guarded
def _output_loop(engine: EngineCore, sender: _Sender, stop: threading.Event) -> None:
    while not stop.is_set():
        outputs = engine.get_results(timeout=IDLE_CHECK_MS / 1000)
        if outputs:
            sender.send([wire.OUTPUTS, [wire.encode_output(o) for o in outputs]])
