"""The engine step loop: scheduler -> resource manager -> model runner -> token processor.

One loop serves the offline ``LLM``, the asyncio client and the server's engine process.
Each step:

1. apply aborts that other threads asked for (they only queue an id and wake the loop);
2. take new requests from the request scheduler while the resource manager has room for them
   (the rest stay in the scheduler, where its ordering hook, TTL and size limit apply);
3. ``resource_manager.schedule()`` plans the batch;
4. the runner computes it and samples;
5. ``token_processor.process`` turns tokens into outputs and frees finished requests' blocks;
6. ``scheduler.put_results`` routes outputs to their origin.

When there is nothing to run, :meth:`EngineCore.run` blocks inside
``scheduler.get_requests(timeout=None)`` until a request arrives or :meth:`wake` is called:
there is no polling sleep.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.errors import RequestError
from fd_core.outputs import RequestOutput, StepResult
from fd_core.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.resource_manager import KVLimits, KVStats, ResourceManager
    from fd_core.contracts.scheduler import Scheduler
    from fd_core.contracts.token_processor import TokenProcessor
    from fd_core.outputs import StepPlan
    from fd_core.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """Counters for /metrics (totals since start unless noted)."""

    kv: KVStats
    num_waiting_in_scheduler: int   # now
    num_steps: int
    num_prompt_tokens: int          # computed prompt tokens (excluding prefix-cache hits)
    num_generated_tokens: int


class EngineCore:
    """Owns the seam plugins and the runner; thread-safe front door, single-threaded loop."""

    def __init__(self, *, scheduler: Scheduler, resource_manager: ResourceManager,
                 token_processor: TokenProcessor, runner: ModelRunner | Any, limits: KVLimits,
                 hooks: Any, tokenizer: Any, model_name: str, config: FdConfig | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.resource_manager = resource_manager
        self.token_processor = token_processor
        self.runner = runner
        self.limits = limits
        self.hooks = hooks
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._aborts: deque[str] = deque()       # ids queued by other threads
        self._in_engine: dict[str, Request] = {} # admitted to the resource manager, not finished
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
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

    def add_request(self, request: Request) -> None:
        """Validate and queue a request. Raises RequestError or QueueFullError; never blocks."""
        self.validate(request)
        self.scheduler.put_request(request)

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request; its blocks are freed at the start of the next step."""
        self._aborts.append(request_id)
        self.scheduler.wake()

    def get_results(self, timeout: float | None) -> list[RequestOutput]:
        """Outputs routed back to this origin (see Scheduler.get_results)."""
        return self.scheduler.get_results(timeout)

    def wake(self) -> None:
        """Make an idle :meth:`run` re-check its stop event."""
        self.scheduler.wake()

    # --- the loop (engine thread only) ---------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set; block while idle."""
        self.hooks.fd_engine_started(config=self.config)
        try:
            while not stop.is_set():
                try:
                    if not self.resource_manager.has_unfinished() and not self._aborts:
                        # idle: block until a request arrives or wake() is called
                        self._admit(self.scheduler.get_requests(self._room(), timeout=None))
                    self.step()
                except Exception:  # a plugin bug must not strand clients: fail what is in flight
                    log.exception("engine step failed; failing %d in-flight requests", len(self._in_engine))
                    self.scheduler.put_results(self.fail_in_flight("engine step failed; see the server log"))
        finally:
            self.hooks.fd_engine_stopped()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns (and routes) the outputs it produced."""
        outputs = self._apply_aborts()
        self._admit(self.scheduler.get_requests(self._room(), timeout=0))
        plan = self.resource_manager.schedule()
        if not plan.is_empty:
            outputs.extend(self._execute(plan))
        self._stats = self._collect_stats()
        self.scheduler.put_results(outputs)
        return outputs

    def has_unfinished(self) -> bool:
        """True while any request is queued, waiting or running."""
        return bool(self._in_engine) or self.scheduler.num_waiting() > 0 or bool(self._aborts)

    def stats(self) -> EngineStats:
        """Counters as of the end of the last step; safe to call from any thread."""
        return self._stats

    def _collect_stats(self) -> EngineStats:
        return EngineStats(self.resource_manager.stats(), self.scheduler.num_waiting(), self._num_steps,
                           self._num_prompt_tokens, self._num_generated_tokens)

    # --- internals ---------------------------------------------------------------------------

    def _room(self) -> int:
        """How many more requests the resource manager should hold (running + waiting)."""
        return max(0, self.limits.max_num_seqs - len(self._in_engine))

    def _admit(self, requests: list[Request]) -> None:
        refused = []
        for request in requests:
            self._in_engine[request.request_id] = request
            try:
                self.token_processor.add_request(request)
                self.resource_manager.add_request(request)
                self.hooks.fd_request_added(request=request)
            except Exception as exc:  # one plugin failure refuses this request, not the batch
                log.exception("could not admit %r", request)
                self.resource_manager.abort(request.request_id)
                refused.append(self._error_output(request, f"could not admit the request: {exc}"))
        self.scheduler.put_results(refused)

    def _error_output(self, request: Request, error: str) -> RequestOutput:
        """Final output for a request the plugins could not finish cleanly; forgets it."""
        self._in_engine.pop(request.request_id, None)
        self.runner.release([request.request_id])
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, FinishReason.ERROR, error
        return RequestOutput(request.request_id, finished=True, finish_reason=FinishReason.ERROR, error=error,
                             num_prompt_tokens=request.num_prompt_tokens)

    def _execute(self, plan: StepPlan) -> list[RequestOutput]:
        self._num_steps += 1
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # a runner failure fails this batch, not the engine
            log.exception("model runner failed on a step of %d rows", len(plan.scheduled))
            return [self._finish(row.request, FinishReason.ERROR, f"model runner failed: {exc}")
                    for row in plan.scheduled if not row.request.is_finished]
        outputs = self.token_processor.process(plan, result)
        self._count_tokens(plan, result)
        for output in outputs:
            if output.finished:
                self._retire(output)
        self.hooks.fd_step_finished(plan=plan, result=result, stats={"kv": self.resource_manager.stats()})
        return outputs

    def _count_tokens(self, plan: StepPlan, result: StepResult) -> None:
        for row in plan.scheduled:
            n_prompt = row.request.num_prompt_tokens
            self._num_prompt_tokens += max(0, min(row.start + row.num_new_tokens, n_prompt) - row.start)
        self._num_generated_tokens += len(result.sampled)

    def fail_in_flight(self, error: str) -> list[RequestOutput]:
        """Finish every admitted request with ``error`` (after a failed step); returns their outputs."""
        outputs = []
        for request in list(self._in_engine.values()):
            try:
                outputs.append(self._finish(request, FinishReason.ERROR, error))
            except Exception:  # the plugin that failed may fail again; still answer the request
                log.exception("could not finish %r cleanly", request)
                outputs.append(self._error_output(request, error))
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        while self._aborts:
            request_id = self._aborts.popleft()
            if self.scheduler.abort(request_id):
                continue  # still queued: the scheduler answered it
            request = self._in_engine.get(request_id)
            if request is None:
                continue  # already finished, or unknown
            self.resource_manager.abort(request_id)
            outputs.append(self._finish(request, FinishReason.ABORT, None, free=False))
        return outputs

    def _finish(self, request: Request, reason: FinishReason, error: str | None, *, free: bool = True) -> RequestOutput:
        """Finish a request outside the token processor (abort, runner error)."""
        if free:
            self.resource_manager.finish_requests([request], reason)
        output = self.token_processor.finish(request, reason, error)
        self._retire(output)
        return output

    def _retire(self, output: RequestOutput) -> None:
        request = self._in_engine.pop(output.request_id, None)
        self.runner.release([output.request_id])
        if request is not None:
            self.hooks.fd_request_finished(request=request, output=output)
