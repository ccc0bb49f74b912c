"""The ``global`` request scheduler: instances sharing one Redis form a pool that balances work.

Every request an instance accepts (its *origin*) goes to the origin's own queue in Redis; each
instance serves its own queue first and, with room to spare, takes requests from the busiest
peer whose queue holds at least ``steal_min_queued``. The taker holds a stolen request under a
lease (renewed each heartbeat) and routes its outputs back to the origin, whose clients stream
them as if the origin had computed them. The Redis side (keys, atomic scripts, fencing on lease
ids) is in :mod:`.store`. Queues in Redis are FIFO; the ``fd_order_waiting`` hooks order each batch
handed to the engine, not the whole pool's queue.

**No Redis I/O in the engine step.** ``get_requests`` hands out what a background I/O thread
has already taken (up to the room the engine asked for at its last call), ``put_results`` and
``abort`` leave outputs and withdrawals to that thread, which sends each batch in one script
(several engine steps' outputs when Redis is slower than a step). The I/O thread takes nothing
while the engine's KV cache has no room (:meth:`note_capacity`: requests wait in the resource
manager, or no block is free): what is queued here stays where idle peers can take it. It takes
no work from peers once the instance drains (:meth:`drain`).

Failures:

- **A holder dies.** Its leases run out after ``lease_s``; the request is queued again at its
  origin, output tokens already routed with it. Whoever takes it next continues from those
  tokens (they are pre-filled as ``output_token_ids``: the KV is recomputed like after a
  preemption and the token processor replays them silently), so the client's stream has no
  duplicate and no gap, whatever the sampling settings. The origin taking one back continues
  from the tokens it has itself received and drops later outputs of the old holder.
- **A holder takes the same request again** after losing its lease (it was slow): the new lease
  has a new id, the old run's outputs are fenced, and the new run is handed to the engine only
  once the engine has ended the old one, so no output of the old run is taken for the new one's.
- **An origin dies.** Nobody can read its requests: holders find it gone at their next heartbeat
  or push and end those requests (:meth:`take_cancelled`), which frees their blocks.
- **An origin's liveness lapses while it lives** (paused, or Redis or the host slow for over
  ``lease_s``): its peers may have reaped it (dropped its queue and output list, given up what
  they held for it). Its next heartbeat finds its ``alive`` key gone or another's and changes
  nothing; the origin then serves every request it originated that is still in the pool itself,
  continuing from the tokens its clients have, withdraws their records and claims its id again
  (``stats()["lapses"]``). If another member claimed the id meanwhile, it turns degraded.
- **Redis is lost.** The instance turns *degraded* (``stats()["degraded_reason"]``): it ends the
  requests it held for peers (their origins serve them again), serves every request it
  originated that was still in the pool itself, continuing from the tokens it received, and
  queues new ones locally. When Redis answers again it withdraws what it left there (records of
  requests it has answered since included), empties its stale queue and rejoins.
- **Redis unreachable at start-up:** a ConfigError naming ``scheduler.options.url``.

Thread use: the engine loop calls get_requests / put_results / take_cancelled / abort /
note_capacity, the engine's input thread put_request, its output thread get_results; a heartbeat
thread, a result-reader thread and the I/O thread run inside. One lock guards the in-memory
state; Redis calls are made outside it.
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

    from fd_core.contracts.resource_manager import KVStats

log = logging.getLogger(__name__)

#: How long one blocking read of routed outputs waits before re-checking for shutdown.
RESULT_BLOCK_S: Final = 0.5


@dataclass(slots=True)
class _Originated:
    """A request this instance accepted and has not answered yet."""

    request: Request
    delivered: list[int]        # output tokens its client has: those it came with (a continuation), then
                                # those passed to get_results
    local: bool = False         # this instance runs it (or has it ready to); peers' outputs are dropped
    remote_seen: bool = False   # a peer's output for it arrived


@dataclass(slots=True)
class _Held:
    """A request run here for a peer, under one lease."""

    request: Request
    lease: str                  # its lease id in Redis: pushes and renewals are fenced on it
    handed: bool = False        # given to the engine: its final output will come through put_results
    cancelled: bool = False     # lease lost or origin gone: its outputs go nowhere; the engine ends it


@dataclass(slots=True)
class _IoJob:
    """One round of the I/O thread's Redis work."""

    outgoing: list[Outgoing] = field(default_factory=list)   # outputs to route, in order
    withdraw: list[str] = field(default_factory=list)        # own requests to remove from the pool
    take_own: int = 0           # take up to this many from the own queue
    steal: int = 0              # then, if the own queue gave nothing, up to this many from the busiest peer


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
            self._store.heartbeat(lease_s=settings.lease_s, held=[], expired=[])
        except (RedisLost, RedisUnsupported) as exc:
            self._store.close()
            raise ConfigError("scheduler.options.url", str(exc)) from None
        except ConfigError:
            self._store.close()
            raise
        self._decisions = GuardedHooks(hooks)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)        # the engine, blocked in get_requests
        self._has_results = threading.Condition(self._lock)   # the output thread, in get_results
        self._io = threading.Condition(self._lock)            # the I/O thread, between jobs
        self._woken = False
        self._ready: deque[Request] = deque()           # for the engine: own requests served here, taken ones
        self._originated: dict[str, _Originated] = {}
        self._held: dict[str, _Held] = {}               # request id -> the run the engine has (or will have)
        self._deferred: dict[str, tuple[Request, _Held | None]] = {}   # id -> a run (own, or held) taken
                                                        # while the engine still runs an earlier run of the id
        self._cancelled: list[str] = []
        self._results: deque[RequestOutput] = deque()
        self._outgoing: list[Outgoing] = []             # for the I/O thread to route, in order
        self._to_withdraw: set[str] = set()             # own ids whose records may still be in Redis
        self._want = 0                                  # requests the engine could take beyond the ready ones
        self._room = True                               # the engine's KV cache has room (note_capacity)
        self._free_slots: int | None = None             # the engine's free request slots (None: not told)
        self._draining = False
        self._next_steal = 0.0                          # monotonic time of the next steal attempt
        self._puts = 0                                  # puts into the own Redis queue so far
        self._queued_in_redis = 0                       # own queue length at the last heartbeat
        self._own_queue_may_hold = True                 # False once a take found the own queue empty
        self._num_instances = 1
        self._degraded: str | None = None
        self._episode = 0                               # lapses and Redis losses so far
        self._counters = dict.fromkeys(("served_for_peers", "taken_by_peers", "leases_expired", "reserved",
                                        "degraded_episodes", "undecodable", "lapses", "deferred"), 0)
        self._stop = threading.Event()
        self._closed = False
        self._threads = [threading.Thread(target=self._heartbeat_loop, name="fd-global-heartbeat", daemon=True),
                         threading.Thread(target=self._result_loop, name="fd-global-results", daemon=True),
                         threading.Thread(target=self._io_loop, name="fd-global-io", daemon=True)]
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
        while (left := self._store.rejoin(lease_s=settings.lease_s, withdraw=[])) is not None:
            if (last_left is not None and left > last_left) or time.monotonic() > deadline:
                raise ConfigError("scheduler.options.instance_id", (
                    f"instance id {self.instance_id!r} belongs to another live member of the pool {settings.topic!r} "
                    f"at {self._store.shown_url}; give each member its own id, or leave it unset (each data-parallel "
                    "rank is a member too)"))
            last_left = left
            time.sleep(min(settings.heartbeat_s / 2, left / 1000 + 0.01))

    # --- origin side ----------------------------------------------------------------------------

    def put_request(self, request: Request) -> None:
        """Queue a request in the pool. One with ``output_token_ids`` (a continuation: a data-parallel
        rank's request moved here after its rank died) goes on after those tokens, wherever it runs."""
        with self._lock:
            if len(self._originated) >= self.max_queue_size:
                raise QueueFullError(f"request queue is full: {len(self._originated)} of this instance's requests "
                                     f"unanswered, the most server.max_queue_size ({self.max_queue_size}) allows; "
                                     "retry, or raise it")
            record = self._originated[request.request_id] = _Originated(request, list(request.output_token_ids))
            if self._degraded is not None:
                self._queue_locally(record)
                return
            episode = self._episode
        try:
            self._store.put(request.request_id, wire.pack(wire.encode_request(request)),
                            list(request.output_token_ids))
        except RedisLost as exc:
            self._lose_redis(str(exc))   # the record is served locally from now on
        with self._lock:
            if self._episode != episode:   # a lapse or a loss came between: the copy just written must go
                self._to_withdraw.add(request.request_id)
            self._puts += 1
            self._own_queue_may_hold = True
            self._io.notify()

    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        with self._lock:
            return drain_results(self._results, self._has_results, timeout)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            record = self._originated.get(request_id)
            if record is None:
                return False
            if record.local:   # ready here (answered now), or running here (the engine ends it)
                deferred = self._deferred.get(request_id)
                if deferred is not None and deferred[1] is None:
                    del self._deferred[request_id]
                    self._answer(record, FinishReason.ABORT, None)
                    return True
                for index, request in enumerate(self._ready):
                    if request.request_id == request_id and request_id not in self._held:
                        del self._ready[index]
                        self._answer(record, FinishReason.ABORT, None)
                        return True
                return False
            self._answer(record, FinishReason.ABORT, None)
            self._to_withdraw.add(request_id)   # a peer holding it drops it at its next push
            self._io.notify()
        return True

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._ready) + self._queued_in_redis

    # --- engine side ------------------------------------------------------------------------------

    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                taken = self._hand_out(max_num)
                self._want = max_num - len(taken)
                if self._want > len(self._ready):
                    self._io.notify()
                if taken or timeout == 0:
                    break
                wait = None if deadline is None else deadline - time.monotonic()
                if self._woken or (wait is not None and wait <= 0):
                    self._woken = False
                    break
                self._wakeup.wait(wait)
        if not taken:
            return []
        return hook_order(self._decisions, taken, time.time()) or taken

    def _hand_out(self, max_num: int) -> list[Request]:
        """Up to ``max_num`` ready requests, oldest first (lock held)."""
        taken = [self._ready.popleft() for _ in range(min(max_num, len(self._ready)))]
        for request in taken:
            held = self._held.get(request.request_id)
            if held is not None and held.request is request:
                held.handed = True
        return taken

    def put_results(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            routed = False
            for output in outputs:
                request_id = output.request_id
                held = self._held.get(request_id)
                if held is not None and held.handed:
                    if not held.cancelled:
                        self._outgoing.append(Outgoing(request_id, held.lease, wire.pack(wire.encode_output(output)),
                                                       output.finished, list(output.new_token_ids)))
                        routed = True
                    if output.finished:
                        del self._held[request_id]
                        self._counters["served_for_peers"] += not held.cancelled
                        self._promote(request_id)
                elif (record := self._originated.get(request_id)) is not None and record.local:
                    self._deliver(output)
            if routed:
                self._io.notify()

    def take_cancelled(self) -> list[str]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, []
            return cancelled

    def note_capacity(self, kv: KVStats, free_slots: int) -> None:
        """Take requests from Redis (own or peers') only while the KV cache has room to start them:
        none waits in the resource manager and a block is free (or nothing runs at all). Take from
        peers only into free slots (fair sharing may ask for own requests beyond them)."""
        room = kv.num_waiting == 0 and (kv.num_free_blocks > 0 or kv.num_running == 0)
        if room != self._room or free_slots != self._free_slots:
            with self._lock:
                self._room, self._free_slots = room, free_slots
                self._io.notify()

    def drain(self) -> None:
        """The instance shuts down: finish what was taken, take nothing more from peers."""
        with self._lock:
            self._draining = True

    def wake(self) -> None:
        with self._lock:
            self._woken = True
            self._wakeup.notify_all()
            self._has_results.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"instance": self.instance_id, "redis_up": int(self._degraded is None),
                    "degraded_reason": self._degraded, "instances": self._num_instances,
                    "holding_for_peers": len(self._held) + sum(held is not None for _, held in self._deferred.values()),
                    "redis_round_trips": self._store.round_trips, **self._counters}

    def close(self) -> None:
        """Route what is left to route, give back what is held for peers and leave the pool."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.wake()
        with self._lock:
            self._io.notify_all()
        heartbeat, results, io = self._threads
        heartbeat.join()
        io.join()
        if self._degraded is None:
            with self._lock:
                held = self._held_leases()
            try:
                self._store.leave(held)
            except RedisLost:
                pass
        results.join()   # (its blocking read may take up to RESULT_BLOCK_S to see the stop)
        self._store.close()

    # --- internals --------------------------------------------------------------------------------

    def _admit(self, row: Taken, undecodable: list[Outgoing]) -> None:
        """Make a taken row ready for the engine (lock held). An own request already answered, or
        served here already, is skipped; a peer's whose payload does not decode is answered with an
        error through ``undecodable``, for the origin's client, and the engine never sees it."""
        if row.reserves:
            self._counters["reserved"] += 1
        if row.origin == self.instance_id:   # continue from what this instance's clients already got
            own = self._originated.get(row.request_id)
            if own is not None and not own.local:
                own.local = True
                self._make_ready(_continuation(own.request, own.delivered), None)
            return
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
            undecodable.append(Outgoing(row.request_id, row.lease, wire.pack(wire.encode_output(error)), True, []))
            return
        held = _Held(_continuation(request, row.delivered), row.lease)
        self._make_ready(held.request, held)

    def _make_ready(self, request: Request, held: _Held | None) -> None:
        """Queue a run for the engine: ``held`` for a peer's request, None for an own one (lock held).

        The engine may still run an earlier run of the same id, held for a peer under a lease that
        is lost or about to be found lost (this member took the request again, or the id came back
        as an own continuation, a data-parallel rank's): the new run then waits until the engine
        has ended that one, so no output of the old run counts for the new one. An earlier run the
        engine never got is dropped (Redis holds the new one's record now).
        """
        request_id = request.request_id
        earlier = self._held.get(request_id)
        if earlier is not None and earlier.handed:
            self._deferred[request_id] = (request, held)
            self._counters["deferred"] += 1
            return
        if earlier is not None:
            self._remove_ready(earlier.request)
            del self._held[request_id]
        if held is not None:
            self._held[request_id] = held
        self._ready.append(request)
        self._wakeup.notify_all()

    def _promote(self, request_id: str) -> None:
        """The engine ended its run of ``request_id``: a run deferred meanwhile becomes ready (lock held)."""
        if request_id in self._cancelled:   # that cancel was the old run's
            self._cancelled.remove(request_id)
        deferred = self._deferred.pop(request_id, None)
        if deferred is not None:
            self._make_ready(*deferred)

    def _remove_ready(self, request: Request) -> None:
        for index, ready in enumerate(self._ready):
            if ready is request:
                del self._ready[index]
                return

    def _held_leases(self) -> list[tuple[str, str]]:
        """(request id, lease) of every request held for peers and not given up (lock held)."""
        return ([(rid, held.lease) for rid, held in self._held.items() if not held.cancelled]
                + [(rid, held.lease) for rid, (_, held) in self._deferred.items() if held is not None])

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
        self._ready.append(_continuation(record.request, record.delivered))
        self._wakeup.notify_all()

    def _serve_own_locally(self) -> list[str]:
        """Serve here every own request still in the pool (lock held); returns their ids, whose
        records in Redis must be withdrawn."""
        moved = [request_id for request_id, record in self._originated.items() if not record.local]
        for request_id in moved:
            self._queue_locally(self._originated[request_id])
        self._to_withdraw.update(moved)
        self._episode += 1
        return moved

    def _cancel(self, runs: list[tuple[str, str]]) -> None:
        """Give up runs ((request id, lease) pairs) held for peers: the engine ends them, their outputs
        are dropped; one the engine never got is just forgotten."""
        with self._lock:
            for request_id, lease in runs:
                held = self._held.get(request_id)
                if held is not None and held.lease == lease and not held.cancelled:
                    if held.handed:
                        held.cancelled = True
                        self._cancelled.append(request_id)
                    else:
                        self._remove_ready(held.request)
                        del self._held[request_id]
                        self._promote(request_id)
                deferred = self._deferred.get(request_id)
                if deferred is not None and deferred[1] is not None and deferred[1].lease == lease:
                    del self._deferred[request_id]
            self._woken = True
            self._wakeup.notify_all()
        log.info("dropped %d requests held for peers (origin gone, aborted or lease lost)", len(runs))

    def _lose_redis(self, reason: str) -> None:
        """Turn degraded: serve own requests here, give up what is held for peers."""
        with self._lock:
            if self._degraded is not None:
                return
            self._degraded = reason
            self._counters["degraded_episodes"] += 1
            self._serve_own_locally()
            held = self._held_leases()
            self._outgoing.clear()   # outputs of the runs given up below
        log.warning("%s; serving this instance's own requests locally until it is back", reason)
        self._cancel(held)

    def _recover_lapse(self) -> None:
        """This member's alive key lapsed while it lived: its peers may have dropped its queue and
        output list and given up what they held for it. Serve all of it here and claim the id again."""
        with self._lock:
            moved = self._serve_own_locally()
            self._counters["lapses"] += 1
        log.warning("this member's liveness in Redis lapsed (paused, or Redis or the host slow, for over lease_s = "
                    "%g s): its peers may have dropped its queue; serving the %d requests it had in the pool "
                    "itself, continuing from the tokens its clients have", self.settings.lease_s, len(moved))
        self._rejoin()

    def _rejoin(self) -> bool:
        """Claim the id again and start clean: withdraw what this member left in Redis, empty its
        stale queue and output list, share work again. False while another member holds the id."""
        with self._lock:
            withdraw = list(self._to_withdraw)
        left = self._store.rejoin(lease_s=self.settings.lease_s, withdraw=withdraw)
        if left is not None:
            self._lose_redis(f"instance id {self.instance_id!r} was claimed by another member of the pool while "
                             "this one was not renewing it; serving this instance's requests locally")
            return False
        with self._lock:
            self._to_withdraw.difference_update(withdraw)
            was = self._degraded
            self._degraded = None
            self._own_queue_may_hold = False
            self._io.notify()
        if was is not None:
            log.info("Redis at %s is back; rejoined the pool", self._store.shown_url)
        return True

    def _heartbeat_loop(self) -> None:
        settings = self.settings
        while not self._stop.wait(settings.heartbeat_s):
            try:
                if self._degraded is not None:
                    self._store.check()
                    if not self._rejoin():
                        continue
                self._beat()
            except RedisLost as exc:
                self._lose_redis(str(exc))
            except Exception:   # a bug here must not silently stop the heartbeat
                log.exception("global scheduler heartbeat failed")

    def _beat(self) -> None:
        """One heartbeat script: liveness, load, leases, the queue TTL, reaping."""
        settings = self.settings
        with self._lock:
            held = self._held_leases()
            now = time.time()
            old = [request_id for request_id, record in self._originated.items()
                   if not record.local and not record.remote_seen
                   and now - record.request.arrival_time > settings.ttl_s]
        beat = self._store.heartbeat(lease_s=settings.lease_s, held=held, expired=old)
        if beat.lapsed:
            self._recover_lapse()
            return
        with self._lock:
            self._queued_in_redis = beat.queued
            if beat.queued:
                self._own_queue_may_hold = True
                self._io.notify()
            self._num_instances = beat.num_instances
            self._counters["leases_expired"] += beat.requeued
            for request_id in beat.expired:   # still queued: answered; a taken one stays with its holder
                record = self._originated.get(request_id)
                if record is not None and not record.local:
                    self._answer(record, FinishReason.ERROR,
                                 f"request expired after waiting {settings.ttl_s:g} s in the queue")
        if beat.lost:
            self._cancel(beat.lost)

    def _io_loop(self) -> None:
        """Route outputs, withdraw own requests and take requests from Redis, off the engine's thread."""
        while True:
            with self._lock:
                while not isinstance(job := self._io_job(), _IoJob):
                    if self._stop.is_set():
                        return   # (after routing what was left: a job comes first while there is one)
                    self._io.wait(job)
            self._run(job)

    def _io_job(self) -> _IoJob | float | None:
        """The I/O thread's next job, or how long to wait for one (None: until notified); lock held."""
        if self._degraded is not None:
            return None
        need = self._want - len(self._ready)
        take = need > 0 and self._room and not self._stop.is_set()
        slots = need if self._free_slots is None else self._free_slots - len(self._ready)
        now = time.monotonic()
        may_steal = take and slots > 0 and not self._draining and now >= self._next_steal
        job = _IoJob(self._outgoing, list(self._to_withdraw), need if take and self._own_queue_may_hold else 0,
                     min(need, slots, self.settings.steal_batch) if may_steal else 0)
        if job.outgoing or job.withdraw or job.take_own or job.steal:
            self._outgoing = []
            return job
        return self._next_steal - now if take and slots > 0 and not self._draining else None

    def _run(self, job: _IoJob) -> None:
        settings = self.settings
        rows: list[Taken] = []
        try:
            if job.outgoing:
                fenced = self._store.push(job.outgoing)
                if fenced:
                    self._cancel([(o.request_id, o.lease) for o in fenced])
            if job.withdraw:
                self._store.withdraw(job.withdraw)
                with self._lock:
                    self._to_withdraw.difference_update(job.withdraw)
            if job.take_own:
                puts = self._puts
                rows = self._store.take(self.instance_id, job.take_own, min_queued=1, lease_s=settings.lease_s)
                if len(rows) < job.take_own:
                    with self._lock:
                        if self._puts == puts:   # no put since: the own queue is empty
                            self._own_queue_may_hold = False
            if job.steal and not rows:
                rows = self._store.take("", job.steal, min_queued=settings.steal_min_queued,
                                        lease_s=settings.lease_s)
                if len(rows) < job.steal:
                    with self._lock:
                        self._next_steal = time.monotonic() + settings.poll_s
        except RedisLost as exc:
            self._lose_redis(str(exc))
        if not rows:
            return
        with self._lock:
            undecodable: list[Outgoing] = []
            for row in rows:
                self._admit(row, undecodable)
            self._outgoing += undecodable
            self._wakeup.notify_all()

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
