"""The engine step loop: scheduler -> resource manager -> model runner -> token processor.

One loop serves the offline ``LLM``, the asyncio client and the server's engine process.
Each step:

1. apply aborts that other threads asked for (a request still queued is withdrawn from the
   scheduler by :meth:`EngineCore.abort` itself; one the engine holds is queued for the loop)
   and end the requests the scheduler gave up (``take_cancelled``);
2. take new requests from the request scheduler while the resource manager has room for them
   (the rest stay in the scheduler, where its ordering hook, TTL and size limit apply);
3. with a proposer (speculative decoding, :mod:`fd_core.engine.speculation`), decoding requests
   get proposed tokens; ``resource_manager.schedule()`` plans the batch;
4. the runner computes it and samples (and verifies proposals);
5. ``token_processor.process`` turns tokens into outputs and *reports* finishes in them (once per
   token of a verified run, then the rows' computed counts are rolled back to what was accepted); the core
   gathers each request's prompt logprobs (``SamplingParams.prompt_logprobs``) over its prefill
   chunks and puts them on its first output;
6. the core ends every finished request (:meth:`EngineCore._end`) and
   ``scheduler.put_results`` routes the outputs to their origin; ``scheduler.note_capacity``
   gets the resource manager's figures of the step (a scheduler that takes work from other
   instances takes none while no request could start here).

**One owner of a request's end.** Once a request has left the scheduler, :meth:`_end` is the
only code that ends it, for every reason (stop, length, abort, error): it frees its blocks
(``resource_manager.finish_requests``, once per reason per step), sets its status, finish
reason and time, forgets it in the runner and the token processor, fills the final output's
metrics and calls ``fd_request_finished``, each exactly once. A request that never left the
scheduler (expired, aborted while queued) is answered by the scheduler.

Request ids are unique among live requests: :meth:`add_request` refuses an id whose final
output has not yet been taken through :meth:`get_results`, touching nothing of the first.

**Fair sharing** of the ``max_num_seqs`` slots (room, in step 2) between client calls: a call
holding more than its share gives a slot up to a call holding fewer, and the request giving it
up is parked in the core until a slot frees (:mod:`fd_core.engine.fair_share`).

When there is nothing to run, :meth:`EngineCore.run` blocks inside
``scheduler.get_requests(timeout=None)`` until a request arrives or :meth:`wake` is called:
there is no polling sleep. A step that raises fails the requests in flight, and the loop then
backs off (:data:`FAILURE_BACKOFF_S`) so that a plugin failing on every call cannot spin it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from fd_core.engine.fair_share import FairShare
from fd_core.engine.speculation import Speculation
from fd_core.errors import PluginError, QueueFullError, RequestError
from fd_core.outputs import RequestMetrics, RequestOutput, ScheduledRequest, StepPlan, StepResult
from fd_core.plugin_guard import FailureReporter, GuardedHooks, plugin_label
from fd_core.request import FinishReason, Request, RequestStatus
from fd_core.splitwise.roles import MIXED, EngineHandoff

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.proposer import Proposer
    from fd_core.contracts.resource_manager import KVLimits, KVStats, ResourceManager
    from fd_core.contracts.scheduler import Scheduler
    from fd_core.contracts.token_processor import TokenProcessor
    from fd_core.hook_trace import HookTracer
    from fd_core.outputs import SampledToken
    from fd_core.runner.constraints import Constraints
    from fd_core.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

#: Wait after a failed step, doubling per consecutive failure from the first value to the second.
FAILURE_BACKOFF_S: Final = (0.05, 2.0)

#: A request to end: (request, reason, error, the token processor's output reporting it or None).
_Ending = tuple[Request, FinishReason, "str | None", "RequestOutput | None"]


@dataclass(slots=True)
class EngineStats:
    """Counters for /metrics (totals since start unless noted)."""

    kv: KVStats
    num_waiting_in_scheduler: int   # now
    num_steps: int
    num_prompt_tokens: int          # computed prompt tokens (excluding prefix-cache hits)
    num_generated_tokens: int
    scheduler: dict[str, Any]       # the scheduler's own figures (Scheduler.stats), now
    splitwise: dict[str, Any]       # the hand-off's counters (prefill and decode instances)
    hooks: list[dict[str, Any]]     # per hook implementation: calls, errors, seconds (plugins.trace_hooks)
    num_proposed_tokens: int = 0    # speculative decoding: proposed tokens the runner verified
    num_accepted_tokens: int = 0    # and those it accepted (also in num_generated_tokens)
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes by part at start-up (MemoryUsage)
    busy_seconds: float = 0.0       # wall time in steps that ran a batch (scheduling, runner, outputs)
    runner_seconds: float = 0.0     # of which in the model runner (forward pass, sampling, verification)
    cpu_seconds: float = 0.0        # CPU time of the process running the engine (every thread), now


class EngineCore:
    """Owns the seam plugins and the runner; thread-safe front door, single-threaded loop."""

    def __init__(self, *, scheduler: Scheduler, resource_manager: ResourceManager,
                 token_processor: TokenProcessor, runner: ModelRunner | Any, limits: KVLimits,
                 hooks: Any, tokenizer: Any, model_name: str, config: FdConfig | None = None,
                 handoff: EngineHandoff = MIXED, hook_tracer: HookTracer | None = None,
                 constraints: Constraints | None = None, proposer: Proposer | None = None) -> None:
        """``handoff``: this instance's part in prefill/decode hand-offs (``fd_core.splitwise``);
        ``hook_tracer``: per-hook figures for :meth:`stats` (``plugins.trace_hooks``);
        ``constraints``: guided decoding, shared with the runner's sampler (None: requests with a
        constraint are refused); ``proposer``: speculative decoding (None: off)."""
        self.config = config
        self.constraints = constraints
        self.scheduler = scheduler
        self.resource_manager = resource_manager
        self.token_processor = token_processor
        self.runner = runner
        self.limits = limits
        self.hooks = hooks                       # the pluggy relay; the core calls it through _hooks
        self._hooks = GuardedHooks(hooks)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.handoff = handoff
        self._hook_tracer = hook_tracer
        self._aborts: deque[str] = deque()       # ids queued by other threads
        self._in_engine: dict[str, Request] = {} # left the scheduler, not ended (engine thread only)
        self._shares = FairShare(limits.max_num_seqs)   # who holds a slot, who is parked (engine thread only)
        self._fair_share = config is None or config.engine.fair_share
        self._live: set[str] = set()             # accepted, final output not yet taken (any thread)
        self._live_lock = threading.Lock()
        self._unrouted: set[str] = set()         # computed for another instance: outputs go nowhere
        self._idle = True                        # the last step had nothing to do
        self._wakeup = threading.Event()         # set by wake(): an idle loop with no room waits on it
        self._failures = FailureReporter()
        self._speculation = Speculation(
            proposer, max_model_len=limits.max_model_len, failures=self._failures,
            max_tokens_per_step=config.proposer.max_proposed_tokens_per_step if config is not None else None,
            **({"can_verify": constraints.can_verify} if constraints is not None else {}))
        self._started = False                    # start() ran (fd_engine_started was called)
        self._closed = False                     # close() ran
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._busy_seconds = 0.0
        self._runner_seconds = 0.0
        self._stats = self._collect_stats()   # replaced whole after every step; read from any thread

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # --- front door (any thread) -------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise RequestError naming the field when the request can never be served."""
        try:
            request.sampling_params.validate()
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise RequestError(field, str(exc)) from exc
        limits = self.limits
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise RequestError("prompt", "prompt is empty")
        if n_prompt >= limits.max_model_len:
            raise RequestError("prompt", f"prompt has {n_prompt} tokens; max_model_len is "
                               f"{limits.max_model_len}, which must also leave room for at least one output token")
        max_tokens = request.sampling_params.max_tokens
        if n_prompt + max_tokens > limits.max_model_len:
            raise RequestError("max_tokens", f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                               f"{n_prompt + max_tokens} exceeds max_model_len ({limits.max_model_len})")
        blocks_needed = -(-(n_prompt + max_tokens) // limits.block_size)
        if blocks_needed > limits.num_blocks:
            raise RequestError("max_tokens", f"prompt + max_tokens needs {blocks_needed} KV blocks; "
                               f"the cache holds {limits.num_blocks}")
        vocab = self.runner.arch.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t in request.sampling_params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("stop_token_ids", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t in request.sampling_params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("logit_bias", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if request.sampling_params.guided is not None:
            if self.constraints is None:
                raise RequestError("guided", "guided: this engine was built without guided decoding")
            self.constraints.check(request)   # compiles (the backend caches): a bad constraint is refused here

    def add_request(self, request: Request) -> None:
        """Validate and queue a request; never blocks.

        Raises RequestError (invalid, or its id is already live), QueueFullError, or PluginError
        when the scheduler plugin fails on it; in every case nothing else is touched.
        """
        self.validate(request)
        request_id = request.request_id
        with self._live_lock:
            if request_id in self._live:
                raise RequestError("request_id", f"request id {request_id!r} is already in use by a live request; "
                                   "ids must be unique until the final output has been read")
            self._live.add(request_id)
        try:
            self.scheduler.put_request(request)
        except (RequestError, QueueFullError):
            self._forget_id(request_id)
            raise
        except Exception as exc:  # a scheduler plugin bug: refuse this request, keep serving
            self._forget_id(request_id)
            raise PluginError(plugin_label(self.scheduler), f"put_request failed on request {request_id!r}: "
                              f"{type(exc).__name__}: {exc}") from exc

    def abort(self, request_id: str) -> None:
        """Abort a request. One still queued in the scheduler is withdrawn (and answered) before this
        returns, so that its place in the queue is free for the next request (a refused request's
        choices must not keep a request that fits out); the loop ends one it holds at the start of
        the next step and frees its blocks."""
        if self._withdraw(request_id):
            return
        self._aborts.append(request_id)
        self.wake()

    def _withdraw(self, request_id: str) -> bool:
        """``scheduler.abort`` on the caller's thread; False when the request was not queued or the
        plugin failed (the loop then tries again)."""
        try:
            return self.scheduler.abort(request_id)
        except Exception:
            log.exception("%s: abort failed on request %r; retried by the engine loop",
                          plugin_label(self.scheduler), request_id)
            return False

    def drain(self) -> None:
        """The instance is shutting down: what was accepted is still served, the scheduler takes no
        more work from other instances (:meth:`Scheduler.drain`); any thread."""
        self._tell(self.scheduler, "drain")

    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        """Outputs routed back to this origin (see Scheduler.get_results); a final one frees its id."""
        outputs = self.scheduler.get_results(timeout)
        ended = [o.request_id for o in outputs if o.finished]
        if ended:
            with self._live_lock:
                self._live.difference_update(ended)
        return outputs

    def wake(self) -> None:
        """Make an idle :meth:`run` look for work again (and re-check its stop event)."""
        self._wakeup.set()
        self.scheduler.wake()

    # --- the loop (engine thread only) ---------------------------------------------------------

    def start(self) -> None:
        """Tell the plugins the engine is about to take requests (``fd_engine_started``); once.

        Every way of running the engine (the offline ``LLM``, ``AsyncLLM``, the server's engine
        process) starts it before its first step and calls :meth:`close` after its last."""
        if not self._started:
            self._started = True
            self._hooks.notify("fd_engine_started", config=self.config)

    def run(self, stop: threading.Event) -> None:
        """:meth:`start`, then step until ``stop`` is set; block while idle. :meth:`close` follows."""
        self.start()
        backoff = 0.0
        while not stop.is_set():
            try:
                if self._idle and not self._aborts and not self.handoff.has_events():
                    self._wait_for_work()
                self.step()
                backoff = 0.0
            except Exception:  # a plugin bug must not strand clients: fail what is in flight
                log.exception("engine step failed; failing %d in-flight requests", len(self._in_engine))
                self._route(self.fail_in_flight("engine step failed; see the server log"))
                # a plugin that fails on every call must not make this loop spin
                low, high = FAILURE_BACKOFF_S
                backoff = min(high, max(low, 2 * backoff))
                stop.wait(backoff)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns (and routes) the outputs it produced."""
        started = time.perf_counter()
        outputs = self._apply_aborts()
        outputs += self._apply_handoff()
        self._take_in()
        self._speculation.propose(self._in_engine.values())
        try:
            plan = self.resource_manager.schedule()
            self.handoff.planned(plan)
            if not plan.is_empty:
                outputs.extend(self._execute(plan))
        finally:
            self._speculation.clear()
        self._idle = plan.is_empty and not outputs
        if not plan.is_empty:
            self._busy_seconds += time.perf_counter() - started
        self._stats = self._collect_stats()
        self._tell(self.scheduler, "note_capacity", self._stats.kv, self._room())
        return self._route(outputs)

    def has_unfinished(self) -> bool:
        """True while any request is queued, waiting or running."""
        return bool(self._in_engine) or self.scheduler.num_waiting() > 0 or bool(self._aborts)

    def stats(self) -> EngineStats:
        """Counters as of the end of the last step, the scheduler's and the hand-off's as of now;
        safe from any thread."""
        return dataclasses.replace(self._stats, scheduler=self._scheduler_stats(), splitwise=self.handoff.stats(),
                                   hooks=self._hook_tracer.snapshot() if self._hook_tracer is not None else [],
                                   memory=self.runner.memory.as_dict() if self.runner.memory is not None else {},
                                   cpu_seconds=time.process_time())

    def close(self) -> None:
        """After the last step: tell the plugins (``fd_engine_stopped``, if :meth:`start` ran),
        then release the seams' connections and threads (hand-off, scheduler). Later calls do
        nothing."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._hooks.notify("fd_engine_stopped")
        self._tell(self.handoff, "close")
        self._tell(self.scheduler, "close")

    def fail_in_flight(self, error: str) -> list[RequestOutput]:
        """End every admitted request with ``error`` (after a failed step); returns their outputs.
        Requests whose KV the hand-off is shipping are left to it."""
        return self._end([(request, FinishReason.ERROR, error, None) for request in self._in_engine.values()
                          if not self.handoff.holds(request.request_id)])

    # --- internals ---------------------------------------------------------------------------

    def _collect_stats(self) -> EngineStats:
        return EngineStats(self.resource_manager.stats(), self.scheduler.num_waiting(), self._num_steps,
                           self._num_prompt_tokens, self._num_generated_tokens, {}, {}, [],
                           self._speculation.num_proposed_tokens, self._speculation.num_accepted_tokens,
                           busy_seconds=self._busy_seconds, runner_seconds=self._runner_seconds)

    def _scheduler_stats(self) -> dict[str, Any]:
        try:
            return dict(self.scheduler.stats())
        except Exception as exc:
            self._failures.report(plugin_label(self.scheduler), "stats", f"raised {type(exc).__name__}: {exc}")
            return {}

    def _forget_id(self, request_id: str) -> None:
        with self._live_lock:
            self._live.discard(request_id)

    def _room(self) -> int:
        """How many more requests the resource manager should hold (running + waiting)."""
        return max(0, self._free_slots())

    def _free_slots(self) -> int:
        """``max_num_seqs`` less the requests holding a slot (every admitted one not parked); below 0
        while :meth:`_admit` places a request that arrived with every slot taken."""
        return self.limits.max_num_seqs - (len(self._in_engine) - len(self._shares.parked))

    def _take_in(self) -> None:
        """Give the free slots to parked requests of calls under their share, then to new requests
        from the scheduler, then to the other parked requests (fd_core.engine.fair_share)."""
        self._resume_parked(under_share_only=True)
        self._admit(self.scheduler.get_requests(self._intake_size(), timeout=0))
        self._resume_parked(under_share_only=False)

    def _intake_size(self) -> int:
        """How many requests to ask the scheduler for: the free slots; with none free, one more than
        the calls the engine holds when some call holds more than its share (fair sharing), so that
        a scheduler whose order lets calls take turns (``fair_fifo``) hands out a new call's first
        request after at most the next request of each of those calls."""
        room = self._room()
        if room > 0 or not self._fair_share or not self._shares.over_share():
            return room
        if len(self._shares.parked) >= self.scheduler.max_queue_size or self.scheduler.num_waiting() == 0:
            return 0   # the engine parks at most as many requests as the scheduler queues
        return self._shares.num_calls() + 1

    def _admit(self, requests: list[Request]) -> None:
        refused: list[_Ending] = []
        for request in requests:
            if request.request_id in self._in_engine:  # add_request refuses live ids: a scheduler bug
                self._failures.report(plugin_label(self.scheduler), "get_requests",
                                      f"handed out request {request.request_id!r} a second time")
                continue
            self._in_engine[request.request_id] = request
            unservable = self._unservable(request)
            if unservable is not None:
                refused.append(unservable)
                continue
            try:
                self.token_processor.add_request(request)
                if self._free_slots() >= 0 or self._take_slot_for(request):
                    self._start(request)
                else:   # its call holds its share already: it waits in the engine for a free slot
                    self._shares.park(request)
            except Exception as exc:  # one plugin failure refuses this request, not the batch
                log.exception("could not admit %r", request)
                refused.append((request, FinishReason.ERROR, f"could not admit the request: {exc}", None))
                continue
            refused += self._tell_added(request)
        self._route(self._end(refused))

    def _start(self, request: Request) -> None:
        """Hand a request to the hand-off, or give it a slot in the resource manager. A request
        taken back by fair sharing was computed here and goes back to the manager, to recompute."""
        if request.status is RequestStatus.PREEMPTED or not self.handoff.admit(request):
            self._shares.hold(request)
            self.resource_manager.add_request(request)
        else:   # the hand-off's now (a decode instance reserves its blocks): not a slot fair sharing moves
            self._shares.forget(request.request_id)

    def _take_slot_for(self, request: Request) -> bool:
        """Free a slot for ``request`` from a call holding more than its share; False if none does.

        The request giving the slot up is parked: the resource manager forgets it and frees its
        blocks, and it resumes later (:meth:`_resume_parked`) by recomputing its prompt and outputs,
        as after a preemption, so its output is unchanged."""
        donor = self._shares.donor_for(request)
        if donor is None:
            return False
        self.resource_manager.finish_requests([donor], FinishReason.ABORT)   # its K/V is not kept
        donor.status = RequestStatus.PREEMPTED
        donor.num_computed_tokens = 0
        donor.num_preemptions += 1
        self._shares.park(donor)
        return True

    def _resume_parked(self, *, under_share_only: bool) -> None:
        """Give free slots to parked requests (:meth:`FairShare.next_to_resume` picks the order)."""
        refused: list[_Ending] = []
        while self._room() > 0:
            request = self._shares.next_to_resume(under_share_only=under_share_only)
            if request is None:
                break
            try:
                self._start(request)
            except Exception as exc:  # one plugin failure ends this request, not the batch
                log.exception("could not resume %r", request)
                self._shares.forget(request.request_id)
                refused.append((request, FinishReason.ERROR, f"could not resume the request: {exc}", None))
        self._route(self._end(refused))

    def _unservable(self, request: Request) -> _Ending | None:
        """The ending of a request this instance can never serve, or None. Requests from the front
        door (:meth:`add_request`) were validated there and pass; those a pool scheduler took from a
        peer or a decode instance sent were validated where they came from, against that instance's
        limits (a larger KV pool or max_model_len, another vocabulary), so each is checked here: one
        that cannot fit would otherwise wait for room forever, and an id outside the vocabulary
        fails a whole step."""
        with self._live_lock:
            if request.request_id in self._live:
                return None
        try:
            self.validate(request)
        except RequestError as exc:
            return request, FinishReason.ERROR, f"this instance cannot serve the request ({exc.field}): {exc}", None
        return None

    def _tell_added(self, request: Request) -> list[_Ending]:
        """``fd_request_added`` for an admitted request: the ending of a request a plugin refused, or none."""
        refusal = self._hooks.refusal("fd_request_added", request=request)
        return [] if refusal is None else [(request, FinishReason.ERROR, f"the request was refused by {refusal}", None)]

    def _execute(self, plan: StepPlan) -> list[RequestOutput]:
        self._num_steps += 1
        started = time.perf_counter()
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # a runner failure fails this batch, not the engine
            log.exception("model runner failed on a step of %d rows", len(plan.scheduled))
            return self._end([(row.request, FinishReason.ERROR, f"model runner failed: {exc}", None)
                              for row in plan.scheduled if row.request.request_id in self._in_engine])
        finally:
            self._runner_seconds += time.perf_counter() - started
        self._count_tokens(plan, result)
        if result.prompt_logprobs:   # before the hand-off: a prefill instance ships them with the first token
            for row in plan.scheduled:
                row.request.prompt_logprobs.extend(result.prompt_logprobs.get(row.request.request_id, ()))
        self.handoff.computed(plan, result)
        outputs = self._process(plan, result)
        self._hooks.notify("fd_step_finished", plan=plan, result=result, stats={"kv": self.resource_manager.stats()})
        return outputs

    def _process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Sampled tokens -> outputs (token processor), the prompt logprobs onto each request's first
        output, then end the requests it reports finished, those whose row could not be sampled
        (guided decoding left no token) and those whose prompt logprobs are incomplete."""
        due = {row.request.request_id: row.request for row in plan.scheduled
               if row.request.needs_prompt_logprobs and row.request.request_id in result.sampled}
        outputs = self._speculation.process(self.token_processor, plan, result)
        incomplete = []
        for output in outputs:
            request = due.get(output.request_id)
            if request is None:
                continue
            if len(request.prompt_logprobs) == request.num_prompt_tokens - 1:
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
            else:   # positions came from a prefix cache, or from a prefill instance that sent no logprobs
                incomplete.append((request, FinishReason.ERROR, (
                    f"prompt logprobs: {len(request.prompt_logprobs)} of the {request.num_prompt_tokens - 1} "
                    f"prompt positions were computed; the others came from the prefix cache (resource manager "
                    f"{plugin_label(self.resource_manager)}) or from a prefill instance of an earlier version"),
                    output))
        self._end(incomplete)
        self._end([(self._in_engine[o.request_id], o.finish_reason, o.error, o)
                   for o in outputs if o.finish_reason is not None and o.request_id in self._in_engine])
        return outputs + self._end([(self._in_engine[request_id], FinishReason.ERROR, reason, None)
                                    for request_id, reason in result.failed.items() if request_id in self._in_engine])

    def _wait_for_work(self) -> None:
        """Block until a request arrives or :meth:`wake` is called (no polling sleep)."""
        room = self._room()
        if room > 0:
            self._admit(self.scheduler.get_requests(room, timeout=None))
        else:   # the scheduler would return at once while it holds requests we cannot take
            self._wakeup.wait()
        self._wakeup.clear()

    def _apply_handoff(self) -> list[RequestOutput]:
        """Take what the hand-off brought: prompts to compute for a decode instance, first tokens
        whose KV arrived (they are processed like sampled tokens), requests to end."""
        events = self.handoff.poll(self._room())
        refused: list[_Ending] = []
        for request in events.new_requests:
            self._unrouted.add(request.request_id)
            self._in_engine[request.request_id] = request
            unservable = self._unservable(request)
            if unservable is not None:
                refused.append(unservable)
                continue
            self.resource_manager.add_request(request)
            refused += self._tell_added(request)
        outputs = self._end(refused + [(request, reason, error, None) for request, reason, error in events.ends])
        if events.first_tokens:
            outputs += self._first_tokens(events.first_tokens)
        return outputs

    def _first_tokens(self, arrived: list[tuple[Request, SampledToken]]) -> list[RequestOutput]:
        live = [(request, token) for request, token in arrived if self._in_engine.get(request.request_id) is request]
        plan = StepPlan([ScheduledRequest(request, 0, request.num_prompt_tokens, [], sample=True)
                         for request, _ in live])
        self._num_generated_tokens += len(live)
        return self._process(plan, StepResult({request.request_id: token for request, token in live}))

    def _route(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand outputs to the scheduler for their origin; those of prompts computed for another
        instance go nowhere. Returns what was routed."""
        if self._unrouted:
            kept = [o for o in outputs if o.request_id not in self._unrouted]
            self._unrouted.difference_update(o.request_id for o in outputs if o.finished)
            outputs = kept
        self.scheduler.put_results(outputs)
        return outputs

    def _count_tokens(self, plan: StepPlan, result: StepResult) -> None:
        for row in plan.scheduled:
            n_prompt = row.request.num_prompt_tokens
            self._num_prompt_tokens += max(0, min(row.start + row.num_new_tokens, n_prompt) - row.start)
        self._num_generated_tokens += len(result.sampled) + sum(map(len, result.accepted.values()))

    def _apply_aborts(self) -> list[RequestOutput]:
        endings: dict[str, _Ending] = {}
        while self._aborts:
            request_id = self._aborts.popleft()
            if self.scheduler.abort(request_id):
                continue  # still queued: the scheduler answered it
            request = self._in_engine.get(request_id)
            if request is not None:  # else already ended, or unknown
                endings[request_id] = (request, FinishReason.ABORT, None, None)
        for request_id in self.scheduler.take_cancelled():   # given up by the scheduler: nobody reads it
            request = self._in_engine.get(request_id)
            if request is not None:
                endings[request_id] = (request, FinishReason.ABORT, "the scheduler gave the request up", None)
        return self._end(list(endings.values()))

    def _end(self, endings: list[_Ending]) -> list[RequestOutput]:
        """End requests that left the scheduler: the one place that does (see the module docstring).

        Every seam is told once; a seam that raises is reported (once per plugin and method)
        and the others are still told, so the final output always goes out. Returns the final
        outputs: the token processor's own where it reported the finish, else new ones.
        """
        by_reason: dict[FinishReason, list[Request]] = {}
        for request, reason, _, _ in endings:
            by_reason.setdefault(reason, []).append(request)
        for reason, requests in by_reason.items():
            self._tell(self.resource_manager, "finish_requests", requests, reason)
        now = time.time()
        finals = []
        for request, reason, error, output in endings:
            request_id = request.request_id
            request.status, request.finish_reason, request.error = RequestStatus.FINISHED, reason, error
            request.finished_time = now
            self._in_engine.pop(request_id, None)
            self._shares.forget(request_id)
            self.runner.release([request_id])
            self._tell(self.token_processor, "forget", request_id)
            self._tell(self.handoff, "forget", request_id)
            self._speculation.forget(request_id)
            if output is None:
                output = RequestOutput(request_id, num_prompt_tokens=request.num_prompt_tokens,
                                       num_output_tokens=len(request.output_token_ids),
                                       num_cached_tokens=request.num_cached_tokens)
            output.finished, output.finish_reason, output.error = True, reason, error
            output.metrics = RequestMetrics.snapshot(request)
            self._hooks.notify("fd_request_finished", request=request, output=output)
            finals.append(output)
        return finals

    def _tell(self, plugin: Any, method: str, *args: Any, **kwargs: Any) -> None:
        """Call a seam method while ending requests or closing; a failure is reported, not raised."""
        try:
            getattr(plugin, method)(*args, **kwargs)
        except Exception as exc:
            self._failures.report(plugin_label(plugin), method, f"raised {type(exc).__name__}: {exc}")
