"""The ``global`` request scheduler: instances sharing one Redis form a pool that balances work.

Every request an instance accepts (its *origin*) goes to the origin's own queue in Redis; each
instance serves its own queue first and, with room to spare, takes requests from the busiest
peer whose queue holds at least ``steal_min_queued``. The taker holds a stolen request under a
lease (renewed each heartbeat) and routes its outputs back to the origin, whose clients stream
them as if the origin had computed them. The Redis side (keys, atomic scripts, fencing) is in
:mod:`.store`. Queues in Redis are FIFO; the ``fd_order_waiting`` hooks order each batch taken
from them (up to what the engine has room for), not the whole pool's queue.

Failures:

- **A holder dies.** Its leases run out after ``lease_s``; the request is queued again at its
  origin, output tokens already routed with it. Whoever takes it next continues from those
  tokens (they are pre-filled as ``output_token_ids``: the KV is recomputed like after a
  preemption and the token processor replays them silently), so the client's stream has no
  duplicate and no gap, whatever the sampling settings. The origin taking one back continues
  from the tokens it has itself received and drops later outputs of the old holder.
- **An origin dies.** Nobody can read its requests: holders find it gone at their next heartbeat
  or push and end those requests (:meth:`take_cancelled`), which frees their blocks.
- **Redis is lost.** The instance turns *degraded* (``stats()["degraded_reason"]``): it ends the
  requests it held for peers (their origins serve them again), serves every request it
  originated that was still in the pool itself, continuing from the tokens it received, and
  queues new ones locally. When Redis answers again it empties its stale queue and rejoins.
- **Redis unreachable at start-up:** a ConfigError naming ``scheduler.options.url``.

Thread use: the engine loop calls get_requests / put_results / take_cancelled, the engine's
input thread put_request / abort, its output thread get_results; a heartbeat thread and a
result-reader thread run inside. One lock guards the in-memory state; Redis calls are made
outside it where the order allows.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

from fd_core.contracts.scheduler import Scheduler
from fd_core.errors import ConfigError, QueueFullError
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import RequestOutput
from fd_core.plugin_guard import GuardedHooks
from fd_core.request import FinishReason, Request
from fd_core.server import wire
from fd_plugins.schedulers.local import drain_results, hook_order
from fd_plugins.schedulers.pool.settings import GlobalSchedulerSettings
from fd_plugins.schedulers.pool.store import Outgoing, PoolStore, RedisLost, RedisUnsupported, Taken

if TYPE_CHECKING:
    from pydantic import BaseModel

log = logging.getLogger(__name__)

#: How long one blocking read of routed outputs waits before re-checking for shutdown.
RESULT_BLOCK_S: Final = 0.5


@dataclass(slots=True)
class _Originated:
    """A request this instance accepted and has not answered yet."""

    request: Request
    delivered: list[int] = field(default_factory=list)   # output tokens passed to get_results
    local: bool = False         # this instance runs it (or queued it locally); peers' outputs are dropped
    remote_seen: bool = False   # a peer's output for it arrived


class GlobalScheduler(Scheduler):
    """A pool member: own queue first, work stealing, leases, results routed to the origin."""

    name: ClassVar[str] = "global"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = GlobalSchedulerSettings

    def __init__(self, settings: GlobalSchedulerSettings | None, *, hooks: Any, max_queue_size: int) -> None:
        settings = settings or GlobalSchedulerSettings()
        super().__init__(settings, hooks=hooks, max_queue_size=max_queue_size)
        self.instance_id = settings.instance_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._store = PoolStore(settings.url, settings.topic, self.instance_id,
                                socket_timeout_s=settings.socket_timeout_s, result_block_s=RESULT_BLOCK_S)
        try:
            self._store.check()
            self._claim_instance_id()
            self._store.heartbeat(lease_s=settings.lease_s, held={})
        except (RedisLost, RedisUnsupported) as exc:
            self._store.close()
            raise ConfigError("scheduler.options.url", str(exc)) from None
        except ConfigError:
            self._store.close()
            raise
        self._decisions = GuardedHooks(hooks)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._has_results = threading.Condition(self._lock)
        self._woken = False
        self._local: deque[Request] = deque()          # served here without Redis (degraded, or taken back)
        self._originated: dict[str, _Originated] = {}
        self._held: dict[str, str] = {}                 # request id -> origin, for requests run for peers
        self._cancelled: list[str] = []
        self._results: deque[RequestOutput] = deque()
        self._queued_in_redis = 0                       # own queue length at the last heartbeat
        self._own_queue_may_hold = True                 # False once a take found the own queue empty
        self._num_instances = 1
        self._degraded: str | None = None
        self._counters = dict.fromkeys(("served_for_peers", "taken_by_peers", "leases_expired", "reserved",
                                        "degraded_episodes", "undecodable"), 0)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat_loop, name="fd-global-heartbeat", daemon=True),
                         threading.Thread(target=self._result_loop, name="fd-global-results", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("joined the pool %r at %s as %s", settings.topic, self._store.shown_url, self.instance_id)

    def _claim_instance_id(self) -> None:
        """Make this member the only live one of its instance id, or raise ConfigError. A claim
        left by a dead member (a restart within lease_s) runs out and is taken; one a live member
        renews means two members were given one id, which would take each other's requests as
        their own and drop them."""
        settings = self.settings
        deadline = time.monotonic() + settings.lease_s + 2 * settings.heartbeat_s
        last_left: int | None = None
        while (left := self._store.claim(lease_s=settings.lease_s)) is not None:
            if (last_left is not None and left > last_left) or time.monotonic() > deadline:
                raise ConfigError("scheduler.options.instance_id", (
                    f"instance id {self.instance_id!r} belongs to another live member of the pool {settings.topic!r} "
                    f"at {self._store.shown_url}; give each member its own id, or leave it unset (each data-parallel "
                    "rank is a member too)"))
            last_left = left
            time.sleep(min(settings.heartbeat_s / 2, left / 1000 + 0.01))

    # --- origin side ----------------------------------------------------------------------------

    def put_request(self, request: Request) -> None:
        with self._lock:
            if len(self._originated) >= self.max_queue_size:
                raise QueueFullError(f"request queue is full: {len(self._originated)} of this instance's requests "
                                     f"unanswered, the most server.max_queue_size ({self.max_queue_size}) allows; "
                                     "retry, or raise it")
            record = self._originated[request.request_id] = _Originated(request)
            if self._degraded is not None:
                self._queue_locally(record)
                return
        try:
            self._store.put(request.request_id, wire.pack(wire.encode_request(request)))
        except RedisLost as exc:
            self._lose_redis(str(exc))   # the record is served locally from now on
        with self._lock:
            self._own_queue_may_hold = True
            self._wakeup.notify_all()

    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        with self._lock:
            return drain_results(self._results, self._has_results, timeout)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            record = self._originated.get(request_id)
            if record is None:
                return False
            for index, request in enumerate(self._local):
                if request.request_id == request_id:
                    del self._local[index]
                    self._answer(record, FinishReason.ABORT, None)
                    return True
            if record.local:
                return False   # running here: the engine ends it
            self._answer(record, FinishReason.ABORT, None)
            degraded = self._degraded is not None
        if not degraded:
            try:
                self._store.withdraw([request_id])   # a peer holding it drops it at its next push
            except RedisLost as exc:
                self._lose_redis(str(exc))
        return True

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._local) + self._queued_in_redis

    # --- engine side ------------------------------------------------------------------------------

    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = self._take(max_num) if max_num > 0 else []
            if taken or timeout == 0:
                return hook_order(self._decisions, taken, time.time()) or taken
            with self._lock:
                wait = self.settings.poll_s
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                if not self._woken and wait > 0 and (max_num <= 0 or not self._local):
                    self._wakeup.wait(wait)
                if self._woken or (deadline is not None and time.monotonic() >= deadline):
                    self._woken = False
                    return []

    def put_results(self, outputs: list[RequestOutput]) -> None:
        outgoing: list[Outgoing] = []
        with self._lock:
            for output in outputs:
                request_id = output.request_id
                origin = self._held.get(request_id)
                if origin is not None:
                    outgoing.append(Outgoing(request_id, origin, wire.pack(wire.encode_output(output)),
                                             output.finished, list(output.new_token_ids)))
                    if output.finished:
                        del self._held[request_id]
                        self._counters["served_for_peers"] += 1
                elif request_id in self._originated and self._originated[request_id].local:
                    self._deliver(output)
        if outgoing:
            self._push_or_lose(outgoing)

    def _push_or_lose(self, outgoing: list[Outgoing]) -> None:
        """Route outputs of requests held for peers to their origins; cancel the fenced ones."""
        try:
            fenced = self._store.push(outgoing)
        except RedisLost as exc:
            self._lose_redis(str(exc))
            return
        if fenced:
            self._cancel(fenced)

    def take_cancelled(self) -> list[str]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, []
            return cancelled

    def wake(self) -> None:
        with self._lock:
            self._woken = True
            self._wakeup.notify_all()
            self._has_results.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"instance": self.instance_id, "redis_up": int(self._degraded is None),
                    "degraded_reason": self._degraded, "instances": self._num_instances,
                    "holding_for_peers": len(self._held), "redis_round_trips": self._store.round_trips,
                    **self._counters}

    def close(self) -> None:
        self._stop.set()
        self.wake()
        for thread in self._threads:
            thread.join()
        if self._degraded is None:
            try:
                self._store.leave()
            except RedisLost:
                pass
        self._store.close()

    # --- internals --------------------------------------------------------------------------------

    def _take(self, max_num: int) -> list[Request]:
        """Local queue first, then this instance's queue in Redis, then the busiest peer's.

        The own queue is only asked while it may hold something (a put since it was last found
        empty, or the heartbeat saw requests there: re-queued after a lease ran out).
        """
        with self._lock:
            taken = [self._local.popleft() for _ in range(min(max_num, len(self._local)))]
            if self._degraded is not None or len(taken) == max_num:
                return taken
            ask_own, self._own_queue_may_hold = self._own_queue_may_hold, False
        settings = self.settings
        want = max_num - len(taken)
        try:
            rows = self._store.take(self.instance_id, want, min_queued=1, lease_s=settings.lease_s) if ask_own else []
            if len(rows) == want:
                with self._lock:
                    self._own_queue_may_hold = True
            if not rows and not taken:
                rows = self._store.take("", min(want, settings.steal_batch), min_queued=settings.steal_min_queued,
                                        lease_s=settings.lease_s)
        except RedisLost as exc:
            self._lose_redis(str(exc))
            return taken
        undecodable: list[Outgoing] = []
        with self._lock:
            for row in rows:
                request = self._admit(row, undecodable)
                if request is not None:
                    taken.append(request)
        if undecodable:
            self._push_or_lose(undecodable)
        return taken

    def _admit(self, row: Taken, undecodable: list[Outgoing]) -> Request | None:
        """The request a taken row stands for (lock held); None for an own request already answered,
        or for a peer's whose payload does not decode: its error answer goes to ``undecodable``, for
        the origin's client, and the engine never sees it."""
        if row.reserves:
            self._counters["reserved"] += 1
        if row.origin == self.instance_id:   # continue from what this instance's clients already got
            own = self._originated.get(row.request_id)
            if own is None:
                return None
            own.local = True
            return _continuation(own.request, own.delivered)
        try:
            request = wire.decode_request(wire.unpack(row.payload))
        except Exception as exc:   # bytes from Redis: another version's, or damaged
            log.error("request %s from %s in Redis does not decode (%s: %s); answering it with an error",
                      row.request_id, row.origin, type(exc).__name__, exc)
            self._counters["undecodable"] += 1
            error = RequestOutput(row.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                  error=f"pool member {self.instance_id!r} could not decode this request as stored "
                                        f"in Redis ({type(exc).__name__}: {exc}); is every member the same "
                                        "fd-engine version?")
            undecodable.append(Outgoing(row.request_id, row.origin, wire.pack(wire.encode_output(error)), True, []))
            return None
        self._held[request.request_id] = row.origin
        return _continuation(request, row.delivered)

    def _deliver(self, output: RequestOutput) -> None:
        """Pass an output of an own request to get_results (lock held)."""
        record = self._originated[output.request_id]
        record.delivered += output.new_token_ids
        if output.finished:
            del self._originated[output.request_id]
        self._results.append(output)
        self._has_results.notify_all()

    def _answer(self, record: _Originated, reason: FinishReason, error: str | None) -> None:
        """Answer an own request that no engine will run any more (lock held)."""
        request = record.request
        self._deliver(RequestOutput(request.request_id, finished=True, finish_reason=reason, error=error,
                                    num_prompt_tokens=request.num_prompt_tokens,
                                    num_output_tokens=len(record.delivered)))

    def _queue_locally(self, record: _Originated) -> None:
        """Serve an own request here, continuing from what was delivered (lock held)."""
        record.local = True
        self._local.append(_continuation(record.request, record.delivered))
        self._wakeup.notify_all()

    def _cancel(self, request_ids: list[str]) -> None:
        """Give up requests held for peers: the engine ends them, their outputs are dropped."""
        with self._lock:
            for request_id in request_ids:
                if self._held.pop(request_id, None) is not None:
                    self._cancelled.append(request_id)
            self._woken = True
            self._wakeup.notify_all()
        log.info("dropped %d requests held for peers (origin gone, aborted or lease lost)", len(request_ids))

    def _lose_redis(self, reason: str) -> None:
        """Turn degraded: serve own requests here, give up what is held for peers."""
        with self._lock:
            if self._degraded is not None:
                return
            self._degraded = reason
            self._counters["degraded_episodes"] += 1
            held = list(self._held)
            for record in self._originated.values():
                if not record.local:
                    self._queue_locally(record)
        log.warning("%s; serving this instance's own requests locally until it is back", reason)
        self._cancel(held)

    def _rejoin(self) -> None:
        """Redis answers again: drop the stale own queue and results, then share work again."""
        self._store.rejoin()
        with self._lock:
            stale = [request_id for request_id, record in self._originated.items() if record.local]
        if stale:
            self._store.withdraw(stale)
        with self._lock:
            self._degraded = None
        log.info("Redis at %s is back; rejoined the pool", self._store.shown_url)

    def _heartbeat_loop(self) -> None:
        settings = self.settings
        while not self._stop.wait(settings.heartbeat_s):
            try:
                if self._degraded is not None:
                    self._store.check()
                    self._rejoin()
                self._beat()
            except RedisLost as exc:
                self._lose_redis(str(exc))
            except Exception:   # a bug here must not silently stop the heartbeat
                log.exception("global scheduler heartbeat failed")

    def _beat(self) -> None:
        """Liveness, load and leases; then reap expired leases and dead peers; expire old requests."""
        settings = self.settings
        with self._lock:
            held = dict(self._held)
        beat = self._store.heartbeat(lease_s=settings.lease_s, held=held)
        reaped = self._store.reap()
        with self._lock:
            self._queued_in_redis = beat.queued
            if beat.queued:
                self._own_queue_may_hold = True
            self._num_instances = beat.num_instances
            self._counters["leases_expired"] += reaped.expired
            now = time.time()
            old = [request_id for request_id, record in self._originated.items()
                   if not record.local and not record.remote_seen
                   and now - record.request.arrival_time > settings.ttl_s]
        if beat.lost:
            self._cancel(beat.lost)
        if old:
            self._expire(old)

    def _expire(self, request_ids: list[str]) -> None:
        """Answer own requests still queued after ttl_s. One a peer has taken (and produced nothing
        for yet) is not waiting any more: it stays with its holder, whose outputs will come."""
        still_queued = self._store.withdraw_queued(request_ids)
        with self._lock:
            for request_id, queued in zip(request_ids, still_queued, strict=True):
                record = self._originated.get(request_id)
                if queued and record is not None and not record.local:
                    self._answer(record, FinishReason.ERROR,
                                 f"request expired after waiting {self.settings.ttl_s:g} s in the queue")

    def _result_loop(self) -> None:
        """Read outputs peers routed here and pass those of live own requests on."""
        while not self._stop.is_set():
            if self._degraded is not None:
                self._stop.wait(self.settings.heartbeat_s)
                continue
            try:
                packed = self._store.pop_results()
            except RedisLost as exc:
                self._lose_redis(str(exc))
                continue
            with self._lock:
                for data in packed:
                    try:
                        output = wire.decode_output(wire.unpack(data))
                    except Exception as exc:   # bytes from Redis: another version's, or damaged
                        log.error("an output routed here in Redis does not decode (%s: %s, %d bytes); dropped",
                                  type(exc).__name__, exc, len(data))
                        self._counters["undecodable"] += 1
                        continue
                    record = self._originated.get(output.request_id)
                    if record is None or record.local:
                        continue   # answered already, or served here now
                    if not record.remote_seen:
                        record.remote_seen = True
                        self._counters["taken_by_peers"] += 1
                    self._deliver(output)


def _continuation(request: Request, delivered: list[int]) -> Request:
    """A fresh copy of ``request`` that goes on after the ``delivered`` output tokens."""
    return Request(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                   sampling_params=request.sampling_params, eos_token_ids=request.eos_token_ids,
                   arrival_time=request.arrival_time, priority=request.priority, prompt=request.prompt,
                   group_id=request.group_id, output_token_ids=list(delivered))
