"""The prefill side of the hand-off: compute prompts for decode instances and ship their KV.

See :mod:`fd_core.splitwise` for the protocol. Requests from decode instances queue here (in
arrival order, at most ``max_queued``) until the engine has room; the engine computes them like
any prompt; in the step that completes the prompt this side ships every block of it, then the
first token, taking that out of the step's result so that the token processor never sees it.
The prompt logprobs a request asks for go with the first token.
The request then holds its blocks (it has nothing left to compute) until the decode side
confirms or gives up, or goes silent for ``splitwise.stall_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fd_core.hookspecs import hookimpl
from fd_core.request import FinishReason
from fd_core.server import wire
from fd_core.splitwise import protocol
from fd_core.splitwise.roles import HandoffEvents
from fd_core.splitwise.side import LinkedSide

if TYPE_CHECKING:
    from fd_core.contracts.connector import Delivery
    from fd_core.outputs import StepPlan, StepResult
    from fd_core.request import Request
    from fd_core.splitwise.kv_blocks import KVBlockViews


@dataclass(slots=True, eq=False)
class _Job:
    """A prompt computed for a decode instance."""

    request: Request        # local copy; its id is ``<decode side's id>#<attempt>@<decode side's address>``
    origin: str             # the decode side's address
    remote_id: str
    attempt: int
    heard: float            # last message from the decode side (monotonic)
    computing: bool = False # handed to the engine
    done_sent: bool = False # every block and DONE were taken by the connector (link thread)


class PrefillSide(LinkedSide):
    """Computes prompts' KV and first tokens for decode instances (``splitwise.role = "prefill"``)."""

    role: ClassVar[str] = "prefill"

    def __init__(self, *, kv: KVBlockViews, block_size: int, max_queued: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kv = kv
        self.block_size = block_size
        self.max_queued = max_queued
        self._jobs: dict[str, _Job] = {}          # local id -> job, under the lock
        self._queued: deque[_Job] = deque()       # not yet handed to the engine, under the lock
        self._ended: list[tuple[Request, FinishReason, str | None]] = []
        self._shipping: set[str] = set()          # jobs whose blocks are shipped (engine thread)
        self.victim_rule = ShippingIsNotAVictim(self._shipping)

    # --- engine thread -------------------------------------------------------------------------

    def poll(self, room: int) -> HandoffEvents:
        with self._lock:
            new = [self._queued.popleft() for _ in range(min(room, len(self._queued)))]
            for job in new:
                job.computing = True
            events = HandoffEvents(new_requests=[job.request for job in new], ends=self._ended)
            self._ended = []
        return events

    def has_events(self) -> bool:
        with self._lock:
            return bool(self._queued or self._ended)

    def computed(self, plan: StepPlan, result: StepResult) -> None:
        for row in plan.scheduled:
            request_id = row.request.request_id
            if not row.sample or request_id in result.failed:   # a failed row: the core ends it
                continue   # blocks ship once the whole prompt is computed (see ShippingIsNotAVictim)
            with self._lock:
                job = self._jobs.get(request_id)
            if job is None:
                continue
            self._shipping.add(request_id)
            prompt_blocks = row.block_table[:-(-row.request.num_prompt_tokens // self.block_size)]
            for index, block_id in enumerate(prompt_blocks):
                self._link.call(lambda j=job, i=index, b=block_id: self._ship(j, i, b))
            token = wire.token_values(result.sampled.pop(request_id))
            prompt_logprobs = ([wire.token_values(t) for t in row.request.prompt_logprobs]
                               if row.request.needs_prompt_logprobs else None)
            num_blocks = len(prompt_blocks)
            self._link.call(lambda j=job, n=num_blocks, t=token, p=prompt_logprobs: self._send_done(j, n, t, p))

    def holds(self, request_id: str) -> bool:
        return request_id in self._shipping

    def _say_goodbye(self) -> set[str]:
        """Tell every decode side with an open hand-off here to ask elsewhere."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._link.call(lambda j=job: self._send(j.origin, protocol.ABORT, id=j.remote_id, attempt=j.attempt,
                                                     reason="the prefill instance is shutting down"))
        return {job.origin for job in jobs}

    def forget(self, request_id: str) -> None:
        self._shipping.discard(request_id)
        with self._lock:
            job = self._jobs.pop(request_id, None)
        if job is not None:   # ended here (an error), not by the decode side: tell it
            self._link.call(lambda: self._send(job.origin, protocol.ABORT, id=job.remote_id, attempt=job.attempt,
                                               reason="the prefill instance ended the request"))

    def stats(self) -> dict[str, Any]:
        figures = super().stats()
        with self._lock:
            figures["jobs_open"] = len(self._jobs)
            figures["jobs_queued"] = len(self._queued)
        return figures

    # --- link thread ---------------------------------------------------------------------------

    def on_delivery(self, delivery: Delivery) -> None:
        message = delivery.message
        kind = message["kind"]
        if kind == protocol.PREFILL:
            self._on_prefill(delivery.sender, message)
            return
        if kind == protocol.ALIVE:
            with self._lock:
                for remote_id, attempt in message["open"]:
                    job = self._jobs.get(_local_id(remote_id, attempt, delivery.sender))
                    if job is not None:
                        job.heard = time.monotonic()
            return
        local_id = _local_id(message["id"], message["attempt"], delivery.sender)
        with self._lock:
            job = self._jobs.get(local_id)
            if job is None:
                return
            if kind == protocol.ACK:
                self._end(job, FinishReason.LENGTH, None)
                self._counters["jobs_done"] += 1
            elif kind == protocol.ABORT:
                self._end(job, FinishReason.ABORT, f"the decode side gave it up: {message['reason']}")
                self._counters["jobs_aborted"] += 1
        self._wake_engine()

    def on_heartbeat(self, now: float) -> None:
        stalled, open_by_peer = [], {}
        with self._lock:
            for job in self._jobs.values():
                if now - job.heard > self.settings.stall_timeout_s:
                    stalled.append(job)
                else:
                    open_by_peer.setdefault(job.origin, []).append([job.remote_id, job.attempt, job.done_sent])
        self._send_alive(open_by_peer)
        for job in stalled:
            self._send(job.origin, protocol.ABORT, id=job.remote_id, attempt=job.attempt,
                       reason="no message for splitwise.stall_timeout_s")
            # drop what is still queued for it before the blocks are freed: a zero-copy send reads them
            self.connector.forget_peer(job.origin)
        with self._lock:
            for job in stalled:
                if self._jobs.get(job.request.request_id) is job:
                    self._end(job, FinishReason.ABORT, "the decode side went silent (splitwise.stall_timeout_s)")
                    self._counters["jobs_stalled"] += 1
            load = sum(job.request.num_prompt_tokens for job in self._jobs.values())
        if stalled:
            self._wake_engine()
        self.directory.report_load(load)

    def _on_prefill(self, origin: str, message: dict[str, Any]) -> None:
        remote = wire.decode_request(message["request"])
        local = dataclasses.replace(remote, request_id=_local_id(remote.request_id, message["attempt"], origin),
                                    output_token_ids=[])
        refusal = None
        if message["layout"] != self.me.layout:
            refusal = f"KV layout differs: {message['layout']} here is {self.me.layout}"
        with self._lock:
            for old in [j for j in self._jobs.values() if j.origin == origin and j.remote_id == remote.request_id]:
                # an earlier attempt (its ABORT lost): the decode side moved on from it
                self._end(old, FinishReason.ABORT, "superseded by a later attempt")
            if refusal is None and len(self._queued) >= self.max_queued:
                refusal = f"its queue is full ({self.max_queued} prompts, server.max_queue_size)"
            if refusal is None:
                job = _Job(local, origin, remote.request_id, message["attempt"], heard=time.monotonic())
                self._jobs[local.request_id] = job
                self._queued.append(job)
                self._counters["jobs_received"] += 1
            else:
                self._counters["jobs_refused"] += 1
        if refusal is not None:
            self._send(origin, protocol.ABORT, id=remote.request_id, attempt=message["attempt"], reason=refusal)
            return
        self._wake_engine()

    def _ship(self, job: _Job, index: int, block_id: int) -> None:
        if not self._is_open(job):
            return   # ended meanwhile; its blocks may already be someone else's
        buffers = self.kv.read(block_id)
        if self._send(job.origin, protocol.BLOCK, buffers, id=job.remote_id, attempt=job.attempt, index=index):
            self._count("blocks_sent")
            self._count("bytes_sent", sum(b.nbytes for b in buffers))
        else:
            self._give_up(job, f"block {index} was not taken by the connector (the decode side's queue is full)")

    def _send_done(self, job: _Job, num_blocks: int, token: list[Any], prompt_logprobs: list[list[Any]] | None) -> None:
        """Send DONE once every block went; from then on ALIVE says so, which lets the decode side
        tell a DONE lost on the way from one not sent yet."""
        if not self._is_open(job):
            return
        if not self._send(job.origin, protocol.DONE, id=job.remote_id, attempt=job.attempt, blocks=num_blocks,
                          token=token, prompt_logprobs=prompt_logprobs):
            self._give_up(job, "DONE was not taken by the connector (the decode side's queue is full)")
            return
        with self._lock:
            job.done_sent = True

    def _give_up(self, job: _Job, reason: str) -> None:
        """End a job whose hand-off cannot complete: tell the decode side (it asks again, or after
        ``stall_timeout_s`` if this is lost too) and free the blocks."""
        self._send(job.origin, protocol.ABORT, id=job.remote_id, attempt=job.attempt, reason=reason)
        with self._lock:
            if self._jobs.get(job.request.request_id) is job:
                self._end(job, FinishReason.ABORT, f"the hand-off was given up: {reason}")
                self._counters["jobs_given_up"] += 1
        self._wake_engine()

    def _is_open(self, job: _Job) -> bool:
        with self._lock:
            return self._jobs.get(job.request.request_id) is job

    def _end(self, job: _Job, reason: FinishReason, error: str | None) -> None:
        """Drop a job (caller holds the lock); one the engine holds is ended there next step."""
        del self._jobs[job.request.request_id]
        if job.computing:
            self._ended.append((job.request, reason, error))
        else:
            self._queued.remove(job)


class ShippingIsNotAVictim:
    """An ``fd_select_preemption_victim`` implementation, run before every other one (``tryfirst``).

    A connector may send straight from the cache (zero-copy), so the blocks of a request whose
    KV is being shipped must not change until the decode side confirmed: such a request is never
    preempted. The last admitted of the others is, or else the request that needs the blocks
    (it waits until a confirmation frees some). With nothing shipping, the other hooks decide.
    """

    def __init__(self, shipping: set[str]) -> None:
        self._shipping = shipping

    @hookimpl(tryfirst=True)
    def fd_select_preemption_victim(self, running: list[Request], needed_by: Request) -> Request | None:
        if not any(r.request_id in self._shipping for r in running):
            return None
        others = [r for r in running if r.request_id not in self._shipping]
        return others[-1] if others else needed_by


def _local_id(remote_id: str, attempt: int, origin: str) -> str:
    """The engine's id of one attempt: each is a request of its own here (an attempt given up may
    still be in the engine, ending, when the next one arrives)."""
    return f"{remote_id}#{attempt}@{origin}"
