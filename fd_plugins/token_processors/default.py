"""The ``default`` token processor: turns each step's sampled tokens into request outputs.

Per sampled token, in this order:

1. append it to ``request.output_token_ids`` (stamping ``first_token_time`` on the first);
2. stop token: an id in ``request.eos_token_ids`` (unless ``ignore_eos``) or in
   ``stop_token_ids`` finishes with ``stop``; the token is reported in ``new_token_ids`` but
   contributes no text;
3. otherwise detokenize incrementally (:mod:`.detokenizer`): text of an incomplete UTF-8
   character is held back until the character completes;
4. stop strings (:mod:`.stops`) are matched on that text across token boundaries; text that
   may begin a stop string is held back until resolved, and a match finishes with ``stop``;
5. ``max_tokens`` outputs or ``max_model_len`` tokens in all finish with ``length``.

Stop tokens and stop strings only count once the request has ``min_tokens`` outputs (the token
that reaches ``min_tokens`` may itself stop); before that they are ordinary tokens and text.
When a request finishes in a step, held-back text is flushed (or cut at the stop string), so
the deltas concatenate to ``decode(outputs minus a final stop token)`` cut at the stop string.

A finish is *reported* by the output's ``finish_reason``; the engine core ends the request.
:meth:`DefaultTokenProcessor.forget` drops the request's state, including held-back text (at
most an incomplete character and a partial stop string): an aborted stream ends with what was
already sent.

A request that arrives with ``output_token_ids`` already filled (a continuation: see the
Scheduler contract) has them replayed through the detokenizer and the stop-string matcher
without output, so text held back across the splice and stop strings spanning it come out
exactly as if one instance had served the whole request.

Metrics: the output carrying the first token gets a :class:`~fd_core.outputs.RequestMetrics`
snapshot (the core fills the final output's); the others carry ``metrics=None``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.token_processor import TokenProcessor
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import RequestMetrics, RequestOutput
from fd_core.request import FinishReason
from fd_plugins.token_processors.detokenizer import IncrementalDetokenizer
from fd_plugins.token_processors.stops import StopStringMatcher

if TYPE_CHECKING:
    from fd_core.outputs import SampledToken, StepPlan, StepResult
    from fd_core.request import Request


class DefaultTokenProcessorSettings(BaseModel):
    """``[token_processor.options]`` of the default token processor."""

    model_config = ConfigDict(extra="forbid")

    skip_special_tokens: bool = Field(True, description="Leave special tokens (e.g. <|im_end|>) out of the text.")


@dataclass(slots=True)
class _RequestState:
    """What the processor keeps per unfinished request."""

    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None     # None: the request has no stop strings
    stop_ids: frozenset[int]            # eos ids (unless ignore_eos) and stop_token_ids
    min_tokens: int                     # outputs before stop ids / strings count
    max_tokens: int                     # outputs that finish with ``length``
    want_logprobs: bool                 # sampling_params.logprobs is not None


class DefaultTokenProcessor(TokenProcessor):
    """Stops, incremental detokenization, logprobs, finish reasons and metrics."""

    name: ClassVar[str] = "default"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = DefaultTokenProcessorSettings

    def __init__(self, settings: DefaultTokenProcessorSettings | None, *, tokenizer: object,
                 max_model_len: int) -> None:
        super().__init__(settings or DefaultTokenProcessorSettings(), tokenizer=tokenizer,
                         max_model_len=max_model_len)
        self._skip_special_tokens: bool = self.settings.skip_special_tokens
        self._states: dict[str, _RequestState] = {}   # request id -> state, until finished

    def add_request(self, request: Request) -> None:
        state = self._states[request.request_id] = self._new_state(request)
        for count, token_id in enumerate(request.output_token_ids, start=1):   # a continuation: replay
            if count >= state.min_tokens and token_id in state.stop_ids:
                continue   # cannot happen (it would have finished); keeps the replay's text identical
            text = state.detokenizer.push(token_id)
            if state.stops is not None:
                state.stops.feed(text, active=count >= state.min_tokens)

    def process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Consume one step's sampled tokens; return one output per request that got a token.

        Rows without a sampled token (a prefill chunk that does not reach the end of the
        prompt) produce nothing. Preempted requests keep their state and need nothing here.
        """
        sampled = result.sampled
        if not sampled:
            return []
        now = time.time()
        outputs: list[RequestOutput] = []
        for row in plan.scheduled:
            request = row.request
            token = sampled.get(request.request_id)
            # A finished row was aborted after the plan was made; its last output is already out.
            if token is not None and not request.is_finished:
                outputs.append(self._on_token(request, token, now))
        return outputs

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _new_state(self, request: Request) -> _RequestState:
        params = request.sampling_params
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= frozenset(request.eos_token_ids)
        return _RequestState(
            detokenizer=IncrementalDetokenizer(self.tokenizer, self._skip_special_tokens),
            stops=StopStringMatcher.build(params.stop, include_stop_str=params.include_stop_str_in_output),
            stop_ids=stop_ids, min_tokens=params.min_tokens, max_tokens=params.max_tokens,
            want_logprobs=params.logprobs is not None)

    def _on_token(self, request: Request, token: SampledToken, now: float) -> RequestOutput:
        """Append one token, apply the stop rules and build its output (see the module docstring)."""
        state = self._states.get(request.request_id)
        if state is None:  # not announced through add_request; set it up on first sight
            state = self._states[request.request_id] = self._new_state(request)
        token_id = token.token_id
        outputs = request.output_token_ids
        outputs.append(token_id)
        num_outputs = len(outputs)
        first = request.first_token_time is None
        if first:
            request.first_token_time = now

        may_stop = num_outputs >= state.min_tokens
        stop_token = may_stop and token_id in state.stop_ids
        length = num_outputs >= state.max_tokens or request.num_tokens >= self.max_model_len
        detokenizer = state.detokenizer
        text = "" if stop_token else detokenizer.push(token_id)
        if stop_token or length:
            text += detokenizer.flush()
        reason: FinishReason | None = None
        if state.stops is not None:
            text, matched = state.stops.feed(text, active=may_stop)
            if matched:
                reason = FinishReason.STOP
            elif stop_token or length:
                text += state.stops.flush()
        if reason is None and (stop_token or length):
            reason = FinishReason.STOP if stop_token else FinishReason.LENGTH

        output = RequestOutput(request.request_id, [token_id], text, [token] if state.want_logprobs else [],
                               num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=num_outputs,
                               num_cached_tokens=request.num_cached_tokens)
        if reason is not None:
            output.finished = True
            output.finish_reason = reason
        elif first:
            output.metrics = RequestMetrics.snapshot(request)
        return output

