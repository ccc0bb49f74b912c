"""Conformance kit for Scheduler plugins: hand-out, results, abort, TTL, blocking, threads, order hook.

Use it from a plugin's own pytest, no model or device needed::

    from fd_core.testing.conformance import check_scheduler

    def test_my_scheduler_conforms():
        check_scheduler(MyScheduler)                      # built with MyScheduler.settings_model()
        check_scheduler(MyScheduler, options={"url": "redis://127.0.0.1:6379/0"})
        check_scheduler(lambda hooks, max_queue_size: MyScheduler(None, hooks=hooks,
                                                                  max_queue_size=max_queue_size))

Every check builds its own instance (one at a time, each closed before the next: a cluster
scheduler never sees another kit instance as a peer, except in ``peer_directory``) and drains
what it put. See :data:`SCHEDULER_CHECKS` for the invariants; a failure raises
:class:`~fd_core.testing.conformance.ConformanceError` such as ``scheduler invariant 'handed
out exactly once or answered' broken: request 'r7' was never handed out nor answered (seed 0)``.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from fd_core.contracts.scheduler import PeerDirectory, PeerInfo
from fd_core.errors import QueueFullError
from fd_core.hookspecs import FD_HOOKSPEC_VERSION, hookimpl
from fd_core.outputs import RequestOutput
from fd_core.request import FinishReason, Request, SamplingParams
from fd_core.testing.conformance._factories import ThreadCall, describe, plugin_settings
from fd_core.testing.conformance._report import (
    Check,
    SeamReport,
    Skip,
    broken,
    run_checks,
    wait_until,
)

if TYPE_CHECKING:
    from fd_core.contracts.scheduler import Scheduler

__all__ = ["SCHEDULER_CHECKS", "SchedulerFactory", "check_scheduler", "run_scheduler_checks"]

SEAM: Final = "scheduler"
#: ``factory(hooks, max_queue_size)``: a new scheduler, as the engine builds one.
SchedulerFactory = Callable[[Any, int], "Scheduler"]

#: The TTL the expiry check sets (seconds).
TINY_TTL_S: Final = 0.05
#: Longest wait for something a healthy scheduler does at once (a cluster one may take a heartbeat).
PATIENCE_S: Final = 5.0
#: Once this long passes with nothing new handed out or answered, what is missing counts as lost.
QUIET_S: Final = 2.0
#: Queue bound of the checks that do not test it.
ROOMY_QUEUE: Final = 1000

EXACTLY_ONCE: Final = "handed out exactly once or answered"
AT_MOST_MAX_NUM: Final = "get_requests hands out at most max_num"
NUM_WAITING: Final = "num_waiting counts requests not yet handed out"
RESULTS_ORDER: Final = "results come back once each, in the order put per request"
ROUTED: Final = "get_results returns only outputs of requests this instance put"
ABORT: Final = "abort answers a queued request, which is never handed out"
TTL: Final = "expired requests are answered, never handed out"
BLOCKS: Final = "get_requests blocks without spinning when empty"
WAKE: Final = "a put or wake() releases a blocked get_requests"
THREADS: Final = "thread-safe: concurrent puts and gets hand each request out once"
QUEUE_FULL: Final = "put_request raises QueueFullError when max_queue_size are queued"
ORDER_HOOK: Final = "the fd_order_waiting hook is honoured"
DIRECTORY: Final = "a peer directory lists live peers of a role, least loaded first, not itself"
CLOSE: Final = "close releases the scheduler"


def check_scheduler(plugin: type[Scheduler] | SchedulerFactory, *, options: Mapping[str, Any] | None = None,
                    seed: int = 0, skip: Collection[str] = ()) -> SeamReport:
    """Run every scheduler check; return the report, or raise ConformanceError naming the broken invariants.

    ``plugin`` is a Scheduler class (built with ``settings_model`` validated from ``options``) or
    a ``factory(hooks, max_queue_size)``. ``skip`` names checks not to run (see
    :data:`SCHEDULER_CHECKS`).
    """
    return run_scheduler_checks(plugin, options=options, seed=seed, skip=skip).raise_for_failures()


def run_scheduler_checks(plugin: type[Scheduler] | SchedulerFactory, *, options: Mapping[str, Any] | None = None,
                         seed: int = 0, skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_scheduler`, but never raises for a broken invariant: every check gets a row."""
    return run_checks(SEAM, describe(plugin), SCHEDULER_CHECKS, skip=skip, args=(_Kit(plugin, options, seed),))


class _Kit:
    """Builds schedulers for the checks and makes their requests."""

    def __init__(self, plugin: type[Scheduler] | SchedulerFactory, options: Mapping[str, Any] | None,
                 seed: int) -> None:
        from fd_core.registry import Registry

        if isinstance(plugin, type):
            settings = plugin_settings(plugin, options)
            self.factory: SchedulerFactory = lambda hooks, max_queue_size: plugin(
                settings, hooks=hooks, max_queue_size=max_queue_size)
        elif options:
            raise ValueError("options are for a Scheduler class; a factory builds its own settings")
        else:
            self.factory = plugin
        self.seed = seed
        self.hooks = Registry.from_plugins({}).hooks

    def rng(self, salt: str) -> random.Random:
        return random.Random(f"{self.seed}:{salt}")

    @contextlib.contextmanager
    def scheduler(self, *, hooks: Any = None, max_queue_size: int = ROOMY_QUEUE,
                  build: Callable[[Any, int], Scheduler] | None = None) -> Iterator[Scheduler]:
        scheduler = (build or self.factory)(self.hooks if hooks is None else hooks, max_queue_size)
        try:
            yield scheduler
        finally:
            close(scheduler)

    def request(self, request_id: str, rng: random.Random) -> Request:
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
        return Request(request_id, prompt, SamplingParams(max_tokens=4))


def close(scheduler: Scheduler) -> None:
    try:
        scheduler.close()
    except Exception as exc:
        raise broken(SEAM, CLOSE, f"close() raised {type(exc).__name__}: {exc}") from exc


class _Seen:
    """What came out of a scheduler: hand-outs in order and final answers, by request id."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.handed: Counter[str] = Counter()
        self.order: list[str] = []
        self.requests: dict[str, Request] = {}
        self.answers: dict[str, list[RequestOutput]] = {}

    def take(self, scheduler: Scheduler, max_num: int, timeout: float) -> list[Request]:
        got = scheduler.get_requests(max_num, timeout)
        if len(got) > max(max_num, 0):
            raise broken(SEAM, AT_MOST_MAX_NUM, f"get_requests({max_num}, ...) handed out {len(got)} requests")
        for request in got:
            self.handed[request.request_id] += 1
            self.order.append(request.request_id)
            self.requests[request.request_id] = request
        return got

    def results(self, scheduler: Scheduler, timeout: float) -> list[RequestOutput]:
        got = scheduler.get_results(timeout)
        for output in got:
            self.answers.setdefault(output.request_id, []).append(output)
        return got

    def answered(self, request_id: str) -> bool:
        return any(o.finished for o in self.answers.get(request_id, ()))

    def settled(self, ids: Collection[str]) -> bool:
        return all(self.handed[i] or self.answered(i) for i in ids)

    def drain(self, scheduler: Scheduler, ids: Collection[str], rng: random.Random,
              timeout: float = PATIENCE_S) -> None:
        """Take requests (and answers) until every one of ``ids`` is handed out or answered (or
        nothing new came for :data:`QUIET_S`), then look once more for a second hand-out."""
        deadline = time.monotonic() + timeout
        last_news = time.monotonic()
        while not self.settled(ids) and time.monotonic() < min(deadline, last_news + QUIET_S):
            if self.take(scheduler, rng.randint(1, 5), 0.05) or self.results(scheduler, 0):
                last_news = time.monotonic()
        self.take(scheduler, 8, 0.05)
        self.results(scheduler, 0)

    def verify(self, put: dict[str, Request]) -> None:
        """Each request put was handed out exactly once or answered, and nothing else came out."""
        for request_id, request in put.items():
            times, answered = self.handed[request_id], self.answered(request_id)
            if times > 1:
                raise broken(SEAM, EXACTLY_ONCE,
                             f"request {request_id!r} was handed out {times} times (seed {self.seed})")
            if times and answered:
                raise broken(SEAM, EXACTLY_ONCE, f"request {request_id!r} was handed out and also answered "
                                                 f"by the scheduler (seed {self.seed})")
            if not times and not answered:
                raise broken(SEAM, EXACTLY_ONCE, f"request {request_id!r} was never handed out nor answered "
                                                 f"(seed {self.seed})")
            if times and self.requests[request_id].prompt_token_ids != request.prompt_token_ids:
                raise broken(SEAM, EXACTLY_ONCE, f"request {request_id!r} was handed out with other prompt "
                                                 "tokens than were put")
        strangers = sorted(set(self.handed) - set(put))
        if strangers:
            raise broken(SEAM, EXACTLY_ONCE, f"handed out {strangers[0]!r}, which was never put")


def _put_all(scheduler: Scheduler, requests: list[Request]) -> dict[str, Request]:
    for request in requests:
        scheduler.put_request(request)
    return {r.request_id: r for r in requests}


def _final(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, [1], "x", finished=True, finish_reason=FinishReason.LENGTH,
                         num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=1)


# --- the checks ------------------------------------------------------------------------------

def _exactly_once(kit: _Kit) -> None:
    rng = kit.rng("exactly_once")
    with kit.scheduler() as scheduler:
        put = _put_all(scheduler, [kit.request(f"r{i}", rng) for i in range(24)])
        seen = _Seen(kit.seed)
        seen.drain(scheduler, put, rng)
        seen.verify(put)
        scheduler.put_results([_final(seen.requests[i]) for i in put if seen.handed[i]])
        waiting = scheduler.num_waiting()
        if not isinstance(waiting, int) or waiting < 0:
            raise broken(SEAM, NUM_WAITING, f"num_waiting() returned {waiting!r}")
        if not wait_until(lambda: scheduler.num_waiting() == 0, PATIENCE_S):
            raise broken(SEAM, NUM_WAITING, f"num_waiting() is {scheduler.num_waiting()} after every request "
                                            f"was handed out (still after {PATIENCE_S:g} s)")


def _results_in_order(kit: _Kit) -> None:
    rng = kit.rng("results")
    per_request = 5
    with kit.scheduler() as scheduler:
        put = _put_all(scheduler, [kit.request(f"res{i}", rng) for i in range(6)])
        seen = _Seen(kit.seed)
        seen.drain(scheduler, put, rng)
        seen.verify(put)
        outputs = [RequestOutput(request_id, [k], f"<{k}>", finished=k == per_request - 1,
                                 finish_reason=FinishReason.LENGTH if k == per_request - 1 else None,
                                 num_output_tokens=k + 1)
                   for k in range(per_request) for request_id in put]
        while outputs:   # interleaved across requests, in batches of random sizes
            size = rng.randint(1, 7)
            scheduler.put_results(outputs[:size])
            outputs = outputs[size:]
        got: dict[str, list[RequestOutput]] = {}

        def collect() -> None:
            for output in scheduler.get_results(0.05):
                got.setdefault(output.request_id, []).append(output)

        wait_until(lambda: all(any(o.finished for o in got.get(i, ())) for i in put), PATIENCE_S, poll=collect)
        collect()
        for request_id in sorted(got):
            if request_id not in put:
                raise broken(SEAM, ROUTED, f"get_results returned an output of {request_id!r}, which was never put")
        for request_id in put:
            tokens = [t for o in got.get(request_id, ()) for t in o.new_token_ids]
            if tokens != list(range(per_request)):
                raise broken(SEAM, RESULTS_ORDER, f"outputs of {request_id!r} came back as tokens {tokens}, "
                                                  f"put as {list(range(per_request))} (seed {kit.seed})")
            if not got[request_id][-1].finished or any(o.finished for o in got[request_id][:-1]):
                raise broken(SEAM, RESULTS_ORDER, f"the final output of {request_id!r} did not come back last")
            if [o.new_text for o in got[request_id]] != [f"<{k}>" for k in range(per_request)]:
                raise broken(SEAM, RESULTS_ORDER, f"outputs of {request_id!r} came back with other text than put")


def _abort_queued(kit: _Kit) -> None:
    rng = kit.rng("abort")
    with kit.scheduler() as scheduler:
        put = _put_all(scheduler, [kit.request(f"ab{i}", rng) for i in range(3)])
        if scheduler.abort("never-put"):
            raise broken(SEAM, ABORT, "abort('never-put') returned True for an id that was never put")
        if not scheduler.abort("ab1"):
            raise broken(SEAM, ABORT, "abort('ab1') returned False for a request still queued")
        seen = _Seen(kit.seed)
        wait_until(lambda: seen.answered("ab1"), QUIET_S, poll=lambda: seen.results(scheduler, 0.05))
        if not seen.answered("ab1"):
            raise broken(SEAM, ABORT, f"the aborted queued request 'ab1' got no final output within {QUIET_S:g} s")
        final = next(o for o in seen.answers["ab1"] if o.finished)
        if final.finish_reason is not FinishReason.ABORT:
            raise broken(SEAM, ABORT, f"the aborted queued request 'ab1' was answered with finish reason "
                                      f"{final.finish_reason!r}, not 'abort'")
        seen.drain(scheduler, put, rng)
        if seen.handed["ab1"]:
            raise broken(SEAM, ABORT, "the aborted queued request 'ab1' was handed out after abort() returned True")
        seen.verify(put)
        if scheduler.abort("ab1"):
            raise broken(SEAM, ABORT, "a second abort('ab1') returned True: it was no longer queued")
        if scheduler.abort("ab0"):
            raise broken(SEAM, ABORT, "abort('ab0') returned True for a request already handed out: "
                                      "the engine would never end it")
        if len(seen.answers["ab1"]) != 1:
            raise broken(SEAM, ABORT, f"the aborted request 'ab1' was answered {len(seen.answers['ab1'])} times")


def _ttl_expiry(kit: _Kit) -> None:
    with kit.scheduler() as probe:
        cls, settings = type(probe), probe.settings
    model = cls.settings_model
    if model is None or "ttl_s" not in model.model_fields or settings is None:
        raise Skip("the settings model has no ttl_s")
    tiny = settings.model_copy(update={"ttl_s": TINY_TTL_S})
    rng = kit.rng("ttl")

    def build(hooks: Any, max_queue_size: int) -> Scheduler:
        return cls(tiny, hooks=hooks, max_queue_size=max_queue_size)

    with kit.scheduler(build=build) as scheduler:
        put_at = time.monotonic()
        put = _put_all(scheduler, [kit.request(f"ttl{i}", rng) for i in range(3)])
        time.sleep(3 * TINY_TTL_S)
        seen = _Seen(kit.seed)
        deadline = time.monotonic() + PATIENCE_S
        while not seen.settled(put) and time.monotonic() < deadline:
            # first as an engine with no room (nothing to hand out), then with room
            room = 0 if time.monotonic() < deadline - PATIENCE_S / 2 else 8
            seen.take(scheduler, room, 0.05)
            seen.results(scheduler, 0.05)
        for request_id in put:
            if seen.handed[request_id]:
                raise broken(SEAM, TTL, f"request {request_id!r} was handed out "
                                        f"{time.monotonic() - put_at:.2f} s after it was put, past ttl_s={TINY_TTL_S}")
            if not seen.answered(request_id):
                raise broken(SEAM, TTL, f"request {request_id!r} waited past ttl_s={TINY_TTL_S} s and got no "
                                        f"final output within {PATIENCE_S:g} s")
        seen.take(scheduler, 8, 0.05)
        handed = [i for i in put if seen.handed[i]]
        if handed:
            raise broken(SEAM, TTL, f"request {handed[0]!r} was handed out after it had expired and been answered")


def _blocks_when_empty(kit: _Kit) -> None:
    timeout = 0.3
    with kit.scheduler() as scheduler:
        def blocked() -> tuple[list[Request], float, float]:
            cpu, wall = time.thread_time(), time.monotonic()
            got = scheduler.get_requests(4, timeout)
            return got, time.monotonic() - wall, time.thread_time() - cpu

        call = ThreadCall(blocked).start()
        if not call.join(timeout + PATIENCE_S):
            raise broken(SEAM, BLOCKS, f"get_requests(4, timeout={timeout}) with nothing queued had not returned "
                                       f"after {timeout + PATIENCE_S:g} s")
        assert call.value is not None
        got, elapsed, cpu = call.value
        if got:
            raise broken(SEAM, BLOCKS, f"get_requests handed out {len(got)} requests with nothing queued")
        if elapsed < timeout / 2:
            raise broken(SEAM, BLOCKS, f"get_requests(4, timeout={timeout}) returned after {elapsed:.3f} s with "
                                       "nothing queued: an idle engine loop calling it would spin")
        if cpu > timeout / 3:
            raise broken(SEAM, BLOCKS, f"the thread blocked in get_requests(4, timeout={timeout}) used {cpu:.3f} s "
                                       f"of CPU in {elapsed:.2f} s (time.thread_time): it spins instead of waiting")
        started = time.monotonic()
        scheduler.get_requests(4, 0)
        if time.monotonic() - started > 1.0:
            raise broken(SEAM, BLOCKS, f"get_requests(4, timeout=0) took {time.monotonic() - started:.2f} s: "
                                       "it must not wait")


def _wake_releases(kit: _Kit) -> None:
    grace = 1.5
    with kit.scheduler() as scheduler:
        call = ThreadCall(lambda: scheduler.get_requests(4, PATIENCE_S)).start()
        time.sleep(0.2)
        scheduler.wake()
        if not call.join(grace):
            raise broken(SEAM, WAKE, f"get_requests(4, timeout={PATIENCE_S:g}) went on blocking {grace} s after wake()")
        request = kit.request("wake0", kit.rng("wake"))

        def until_handed_out() -> tuple[list[Request], float]:
            deadline = time.monotonic() + PATIENCE_S + 1
            while True:   # an early empty return is tolerated; being late after the put is not
                got = scheduler.get_requests(4, PATIENCE_S)
                if got or time.monotonic() > deadline:
                    return got, time.monotonic()

        call2 = ThreadCall(until_handed_out).start()
        time.sleep(0.2)
        put_at = time.monotonic()
        scheduler.put_request(request)
        if not call2.join(grace + PATIENCE_S):
            raise broken(SEAM, WAKE, "a blocked get_requests had not returned the request put meanwhile")
        assert call2.value is not None
        got, returned_at = call2.value
        if [r.request_id for r in got] != ["wake0"]:
            raise broken(SEAM, WAKE, f"a blocked get_requests returned {[r.request_id for r in got]} after "
                                     "'wake0' was put")
        if returned_at - put_at > grace:
            raise broken(SEAM, WAKE, f"a blocked get_requests returned {returned_at - put_at:.2f} s after a request "
                                     "was put")


def _concurrent(kit: _Kit) -> None:
    putters, per_putter, getters = 4, 25, 3
    with kit.scheduler() as scheduler:
        put = {f"c{p}-{i}": kit.request(f"c{p}-{i}", kit.rng(f"c{p}-{i}"))
               for p in range(putters) for i in range(per_putter)}
        seen = _Seen(kit.seed)
        answers: Counter[str] = Counter()
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[str] = []

        def guarded(what: str, fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except Exception as exc:
                    errors.append(f"{what} raised {type(exc).__name__}: {exc}")
                    stop.set()
            return run

        def putter(p: int) -> None:
            rng = kit.rng(f"putter{p}")
            for i in range(per_putter):
                scheduler.put_request(put[f"c{p}-{i}"])
                if rng.random() < 0.3:
                    time.sleep(0.001)

        def getter(g: int) -> None:
            rng = kit.rng(f"getter{g}")
            while not stop.is_set():
                got = scheduler.get_requests(rng.randint(1, 4), 0.05)
                with lock:
                    for request in got:
                        seen.handed[request.request_id] += 1
                        seen.requests[request.request_id] = request
                if got:
                    scheduler.put_results([_final(r) for r in got])

        def origin() -> None:
            while not stop.is_set():
                for output in scheduler.get_results(0.05):
                    with lock:
                        if output.finished:
                            answers[output.request_id] += 1

        threads = [threading.Thread(target=guarded(f"put_request in putter thread {p}", lambda p=p: putter(p)))
                   for p in range(putters)]
        threads += [threading.Thread(target=guarded(f"get_requests/put_results in getter thread {g}",
                                                    lambda g=g: getter(g))) for g in range(getters)]
        threads.append(threading.Thread(target=guarded("get_results in the origin thread", origin)))
        for thread in threads:
            thread.daemon = True
            thread.start()

        progress = [0, time.monotonic()]   # (hand-outs + answers seen, when that last changed)

        def done() -> bool:
            with lock:
                if errors or all(answers[i] for i in put):
                    return True
                count = sum(seen.handed.values()) + sum(answers.values())
            if count != progress[0]:
                progress[:] = [count, time.monotonic()]
            return time.monotonic() - progress[1] > QUIET_S and all(not t.is_alive() for t in threads[:putters])

        wait_until(done, 4 * PATIENCE_S, interval=0.02)
        time.sleep(0.1)   # a second hand-out would show now
        stop.set()
        scheduler.wake()
        for thread in threads:
            thread.join(PATIENCE_S)
        if errors:
            raise broken(SEAM, THREADS, errors[0])
        with lock:
            for request_id in put:
                if seen.handed[request_id] != 1:
                    raise broken(SEAM, THREADS, f"request {request_id!r} was handed out {seen.handed[request_id]} "
                                                f"times by {getters} threads getting while {putters} put")
                if answers[request_id] != 1:
                    raise broken(SEAM, THREADS, f"the final output of {request_id!r} came back "
                                                f"{answers[request_id]} times under concurrent put_results")
            strangers = sorted(set(seen.handed) - set(put))
        if strangers:
            raise broken(SEAM, THREADS, f"handed out {strangers[0]!r}, which was never put")


def _queue_full(kit: _Kit) -> None:
    bound = 4
    rng = kit.rng("queue_full")
    with kit.scheduler(max_queue_size=bound) as scheduler:
        requests = [kit.request(f"q{i}", rng) for i in range(bound + 1)]
        for i, request in enumerate(requests[:bound]):
            try:
                scheduler.put_request(request)
            except QueueFullError as exc:
                raise broken(SEAM, QUEUE_FULL, f"put_request raised QueueFullError with {i} of "
                                               f"max_queue_size={bound} queued: {exc}") from exc
        try:
            scheduler.put_request(requests[bound])
        except QueueFullError:
            pass
        except Exception as exc:
            raise broken(SEAM, QUEUE_FULL, f"a put_request past max_queue_size={bound} raised "
                                           f"{type(exc).__name__} instead of QueueFullError: {exc}") from exc
        else:
            raise broken(SEAM, QUEUE_FULL, f"put_request of request {bound + 1} with max_queue_size={bound} did not "
                                           "raise QueueFullError")
        seen = _Seen(kit.seed)
        seen.drain(scheduler, [r.request_id for r in requests[:bound]], rng)
        if seen.handed[requests[bound].request_id]:
            raise broken(SEAM, QUEUE_FULL, "the request refused with QueueFullError was handed out")


class _NewestIdFirst:
    """An ``fd_order_waiting`` implementation the kit registers: highest request id first, not FIFO."""

    fd_hookspec_version = FD_HOOKSPEC_VERSION

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def fd_order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        self.calls += 1
        return sorted(waiting, key=lambda r: r.request_id, reverse=True)


def _order_hook(kit: _Kit) -> None:
    from fd_core.registry import Registry

    hook = _NewestIdFirst()
    rng = kit.rng("order")
    with kit.scheduler(hooks=Registry.from_plugins({}, general=[hook]).hooks) as scheduler:
        put = _put_all(scheduler, [kit.request(f"o{i}", rng) for i in range(6)])
        seen = _Seen(kit.seed)
        deadline = time.monotonic() + PATIENCE_S
        while len(seen.order) < len(put) and time.monotonic() < deadline:
            seen.take(scheduler, len(put), 0.1)
        expected = sorted(put, reverse=True)
        if seen.order != expected:
            raise broken(SEAM, ORDER_HOOK, f"handed out {seen.order}, but the registered fd_order_waiting hook "
                                           f"ordered {expected} (the hook was called {hook.calls} times)")


def _peer_directory(kit: _Kit) -> None:
    with kit.scheduler() as probe:
        if not isinstance(probe, PeerDirectory):
            raise Skip("not a PeerDirectory")
    mine = ("conformance-a", "conformance-c")
    open_: list[Scheduler] = []
    try:
        for _ in range(3):
            open_.append(kit.factory(kit.hooks, ROOMY_QUEUE))
        a, b, c = open_
        assert isinstance(a, PeerDirectory) and isinstance(b, PeerDirectory) and isinstance(c, PeerDirectory)
        a.join(PeerInfo("conformance-a", "prefill", "address-a", "conformance", "host", "layout"))
        c.join(PeerInfo("conformance-c", "prefill", "address-c", "conformance", "host", "layout"))
        b.join(PeerInfo("conformance-b", "decode", "address-b", "conformance", "host", "layout"))
        a.report_load(50)
        c.report_load(5)

        def listed(directory: PeerDirectory, role: str) -> list[str]:
            return [p.instance_id for p in directory.peers(role) if p.instance_id in (*mine, "conformance-b")]

        want = ["conformance-c", "conformance-a"]
        if not wait_until(lambda: listed(b, "prefill") == want, PATIENCE_S, interval=0.05):
            raise broken(SEAM, DIRECTORY, f"peers('prefill') of a decode instance lists {listed(b, 'prefill')}, "
                                          f"expected {want} (least loaded first) within {PATIENCE_S:g} s")
        if "conformance-a" in listed(a, "prefill"):
            raise broken(SEAM, DIRECTORY, "peers('prefill') of prefill instance 'conformance-a' lists itself")
        if listed(b, "decode"):
            raise broken(SEAM, DIRECTORY, "peers('decode') of the only decode instance lists itself")
        open_.remove(a)
        close(a)
        if not wait_until(lambda: listed(b, "prefill") == ["conformance-c"], 2 * PATIENCE_S, interval=0.05):
            raise broken(SEAM, DIRECTORY, f"after 'conformance-a' closed, peers('prefill') still lists "
                                          f"{listed(b, 'prefill')} after {2 * PATIENCE_S:g} s")
    finally:
        for scheduler in open_:
            close(scheduler)


#: The scheduler kit, in the order it runs.
SCHEDULER_CHECKS: Final = (
    Check("exactly_once", EXACTLY_ONCE, _exactly_once),
    Check("results_in_order", RESULTS_ORDER, _results_in_order),
    Check("abort_queued", ABORT, _abort_queued),
    Check("ttl_expiry", TTL, _ttl_expiry),
    Check("blocks_when_empty", BLOCKS, _blocks_when_empty),
    Check("wake_releases", WAKE, _wake_releases),
    Check("concurrent", THREADS, _concurrent),
    Check("queue_full", QUEUE_FULL, _queue_full),
    Check("order_hook", ORDER_HOOK, _order_hook),
    Check("peer_directory", DIRECTORY, _peer_directory),
)
