"""Data that crosses the seams each step: the plan, the runner's result and request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fd_core.request import FinishReason, Request


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step batch: compute ``num_new_tokens`` tokens of ``request``.

    The tokens are ``request.token_slice(start, start + num_new_tokens)`` where
    ``start = request.num_computed_tokens`` at planning time (kept in ``start`` because the
    resource manager advances the request's counter as soon as it plans).
    """

    request: Request
    start: int                 # position of the first new token (= computed tokens before)
    num_new_tokens: int        # tokens to run this step (>= 1)
    block_table: list[int]     # every KV block id of the request, in position order
    sample: bool               # True when this chunk reaches the end of the known tokens

    def __repr__(self) -> str:
        return (f"ScheduledRequest(id={self.request.request_id!r}, start={self.start}, "
                f"new={self.num_new_tokens}, blocks={len(self.block_table)}, sample={self.sample})")


@dataclass(slots=True)
class StepPlan:
    """What the resource manager decided for one engine step.

    ``total_num_tokens`` equals ``sum(r.num_new_tokens for r in scheduled)`` and never exceeds
    the token budget; ``len(scheduled)`` never exceeds ``max_num_seqs``.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)   # lost their blocks this step
    total_num_tokens: int = 0

    @classmethod
    def make_empty(cls) -> StepPlan:
        return cls()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    """The token the runner sampled for one request, with optional log-probabilities."""

    token_id: int
    logprob: float | None = None                           # of the sampled token
    top_logprobs: list[tuple[int, float]] | None = None    # (token id, logprob), best first
    error: str | None = None    # the row could not be sampled (its constraint allows no token); token_id is -1


@dataclass(slots=True)
class StepResult:
    """What the model runner returns for a :class:`StepPlan`.

    ``sampled`` has an entry for exactly the rows whose ``sample`` flag was set, except rows in
    ``failed`` (guided decoding found no token their constraint allows): the core ends those.
    ``prompt_logprobs`` has an entry for the rows of requests that ``needs_prompt_logprobs`` whose
    chunk computed prompt positions they did not have yet. A row that computed proposed tokens has an
    entry in ``num_proposed``, and in ``accepted`` when it accepted some: its tokens this step are
    those, then its ``sampled`` token.
    """

    sampled: dict[str, SampledToken] = field(default_factory=dict)   # request id -> token
    failed: dict[str, str] = field(default_factory=dict)   # request id -> why its row could not be sampled
    # request id -> the logprobs of the prompt tokens this step predicted, in position order, going on
    # from the end of ``request.prompt_logprobs`` (``token_id`` is the prompt token; the core appends them)
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id -> the proposed tokens (``Request.spec_token_ids``) the step verified and accepted, in
    # order; its entry in ``sampled`` follows them (the model's token after the last accepted one)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id -> how many proposed tokens its row computed (accepted or not)
    num_proposed: dict[str, int] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> StepResult:
        return cls()


@dataclass(slots=True)
class RequestMetrics:
    """Per-request timings in seconds (``None`` until known)."""

    arrival_time: float
    queue_time: float | None = None        # arrival -> first scheduled
    ttft: float | None = None              # arrival -> first output token
    tpot: float | None = None              # mean time per output token after the first
    e2e: float | None = None               # arrival -> finished

    @classmethod
    def snapshot(cls, request: Request) -> RequestMetrics:
        """The request's timings so far (from its ``*_time`` stamps)."""
        arrival, first, done = request.arrival_time, request.first_token_time, request.finished_time
        num_outputs = len(request.output_token_ids)
        return cls(
            arrival_time=arrival,
            queue_time=None if request.scheduled_time is None else request.scheduled_time - arrival,
            ttft=None if first is None else first - arrival,
            tpot=(done - first) / (num_outputs - 1) if first is not None and done is not None and num_outputs > 1
            else None,
            e2e=None if done is None else done - arrival,
        )


@dataclass(slots=True)
class RequestOutput:
    """A delta for one request, as handed to ``Scheduler.put_results`` and to clients.

    ``new_token_ids`` / ``new_text`` are what this step added; concatenating every delta's
    ``new_text`` gives the final ``text`` exactly. ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``)
    comes once, on the output carrying the first output token: one entry per prompt token from the
    second on (the first has no logprob), each the prompt token's logprob and its top-n alternatives.
    A continuation (it arrived with output tokens) never carries them: its client has them.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[SampledToken] | None = None   # prompt positions 1.. (see above); None on other outputs
