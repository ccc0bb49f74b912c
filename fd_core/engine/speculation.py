"""The engine core's side of speculative decoding: ask the proposer, then take the verified runs in.

Per step (:class:`Speculation`, one per engine core; without a proposer every method is a no-op):

1. :meth:`Speculation.propose`, before planning: every request that decodes (running, its tokens
   computed but for the last one, at least one output) and is ``speculable`` gets up to ``budget``
   proposed tokens as ``spec_token_ids``: ``proposer.num_speculative_tokens``, or its equal share of
   ``proposer.max_proposed_tokens_per_step`` when that is less (none when the share is below one:
   a large batch has no compute to spare for verifying guesses), cut so that the request cannot pass
   ``max_tokens`` or ``max_model_len`` even if all are accepted.
2. The resource manager plans them, the runner verifies them (``StepResult.accepted``).
3. :meth:`Speculation.process` hands the token processor one token per request per call, in
   order (a run of accepted tokens then the model's next token is several calls), so a stop string
   or ``max_tokens`` inside a run ends the request there and the rest of the run is dropped; each
   request's outputs of the step are merged into one. Then every verified row is rolled back:
   ``num_computed_tokens`` = its known tokens before the step + the accepted ones (the K/V of
   rejected positions is overwritten later, in the blocks the request keeps), at most its tokens
   - 1, as after any step. The proposer observes how many it got right.
4. :meth:`Speculation.clear` drops this step's proposals (the core calls it whatever happened).

A failing proposer is reported once and the step goes on without proposals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from fd_core.outputs import RequestOutput, StepPlan, StepResult
from fd_core.plugin_guard import FailureReporter, plugin_label
from fd_core.request import RequestStatus

if TYPE_CHECKING:
    from fd_core.contracts.proposer import Proposer
    from fd_core.contracts.token_processor import TokenProcessor
    from fd_core.request import Request


class Speculation:
    """Proposals in, verified runs out, for one engine core (see the module docstring)."""

    def __init__(self, proposer: Proposer | None, *, max_model_len: int, max_tokens_per_step: int | None,
                 failures: FailureReporter, can_verify: Callable[[Request], bool] = lambda request: True) -> None:
        """``can_verify`` tells whether guided decoding can verify a request's proposals."""
        self.proposer = proposer
        self.can_verify = can_verify
        self.max_model_len = max_model_len
        self.max_tokens_per_step = max_tokens_per_step   # None: no cap
        self._failures = failures
        self._proposing: list[Request] = []   # requests holding proposals this step
        self.num_proposed_tokens = 0          # totals since start: computed proposals
        self.num_accepted_tokens = 0          # and the accepted ones

    def propose(self, requests: Iterable[Request]) -> None:
        """Set ``spec_token_ids`` on the requests that decode and may speculate (step 1)."""
        if self.proposer is None:
            return
        chosen = [request for request in requests if self._may_speculate(request)]
        share = self.proposer.max_proposed_tokens
        if chosen and self.max_tokens_per_step is not None:
            share = min(share, self.max_tokens_per_step // len(chosen))
        budgets = [self._budget(request, share) for request in chosen]
        chosen, budgets = [r for r, b in zip(chosen, budgets, strict=True) if b > 0], [b for b in budgets if b > 0]
        if not chosen:
            return
        try:
            proposals = self.proposer.propose(chosen, budgets)
            problem = _problem(proposals, budgets, self.proposer.vocab_size)
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem is not None:
            self._failures.report(plugin_label(self.proposer), "propose", problem,
                                  fallback="the step ran without proposals")
            return
        for request, proposal in zip(chosen, proposals, strict=True):
            if proposal:
                request.spec_token_ids = list(proposal)
                self._proposing.append(request)

    def clear(self) -> None:
        """Drop this step's proposals (step 4)."""
        for request in self._proposing:
            request.spec_token_ids = []
        self._proposing.clear()

    def process(self, token_processor: TokenProcessor, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """The token processor's outputs for the step, one per request, and the rollback (step 3)."""
        if not result.num_proposed:
            return token_processor.process(plan, result)
        runs = {request_id: [*result.accepted.get(request_id, ()), token]
                for request_id, token in result.sampled.items()}
        rows = {row.request.request_id: row for row in plan.scheduled}
        merged: dict[str, RequestOutput] = {}
        for i in range(max(map(len, runs.values()))):
            tokens = {request_id: run[i] for request_id, run in runs.items()
                      if i < len(run) and not (request_id in merged and merged[request_id].finished)}
            if i == 0:
                step = token_processor.process(plan, dataclasses.replace(result, sampled=tokens))
            else:
                step = token_processor.process(StepPlan([rows[r] for r in tokens]), StepResult(tokens))
            for output in step:
                first = merged.setdefault(output.request_id, output)
                if first is not output:
                    _append(first, output)
        self._roll_back(rows, result)
        return list(merged.values())

    def forget(self, request_id: str) -> None:
        if self.proposer is not None:
            try:
                self.proposer.forget(request_id)
            except Exception as exc:
                self._failures.report(plugin_label(self.proposer), "forget", f"raised {type(exc).__name__}: {exc}",
                                      fallback="ignored")

    def _may_speculate(self, request: Request) -> bool:
        """Whether ``request`` decodes (running, computed but for its last token, with outputs, past
        ``min_tokens``) and its sampling and constraint can be verified."""
        outputs = len(request.output_token_ids)
        params = request.sampling_params
        return (request.status is RequestStatus.RUNNING and outputs >= max(1, params.min_tokens)
                and request.num_computed_tokens == request.num_tokens - 1 and params.speculable
                and self.can_verify(request))

    def _budget(self, request: Request, share: int) -> int:
        """How many tokens ``request`` may have proposed: its ``share``, cut so that ``max_tokens`` and
        ``max_model_len`` hold even if all are accepted."""
        outputs = len(request.output_token_ids)
        return min(share, request.sampling_params.max_tokens - outputs - 1, self.max_model_len - request.num_tokens - 1)

    def _roll_back(self, rows: dict, result: StepResult) -> None:
        for request_id, num_proposed in result.num_proposed.items():
            row = rows[request_id]
            request = row.request
            accepted = len(result.accepted.get(request_id, ()))
            known = row.start + row.num_new_tokens - num_proposed
            request.num_computed_tokens = min(known + accepted, request.num_tokens - 1)
            self.num_proposed_tokens += num_proposed
            self.num_accepted_tokens += accepted
            try:
                self.proposer.observe(request, num_proposed, accepted)
            except Exception as exc:
                self._failures.report(plugin_label(self.proposer), "observe", f"raised {type(exc).__name__}: {exc}",
                                      fallback="ignored")


def _problem(proposals: object, budgets: list[int], vocab_size: int) -> str | None:
    """Why ``proposals`` (a proposer's answer) cannot be used, or None."""
    if not isinstance(proposals, list) or len(proposals) != len(budgets):
        return f"returned {type(proposals).__name__} instead of a list of {len(budgets)} lists"
    for proposal, budget in zip(proposals, budgets, strict=True):
        if not isinstance(proposal, list) or len(proposal) > budget:
            return f"returned a proposal longer than its budget of {budget} tokens, or not a list"
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in proposal):
            return f"proposed a token id outside [0, {vocab_size})"
    return None


def _append(output: RequestOutput, later: RequestOutput) -> None:
    """Merge the request's ``later`` output of the same step into ``output``."""
    output.new_token_ids += later.new_token_ids
    output.new_text += later.new_text
    output.new_logprobs += later.new_logprobs
    output.finished, output.finish_reason, output.error = later.finished, later.finish_reason, later.error
    output.num_output_tokens = later.num_output_tokens
    output.num_cached_tokens = later.num_cached_tokens
