"""Contract of the TokenProcessor seam: turns sampled tokens into request outputs.

Called once per step after the model ran: :meth:`TokenProcessor.process` appends each sampled
token to its request, checks the stop conditions, detokenizes incrementally and attaches
logprobs. It **reports** a finish by setting ``finish_reason`` (and ``finished``) on that
request's output; it never ends a request itself. The engine core is the one owner of a
request's end: it frees the blocks, sets the request's status and finish time, fills the final
output's metrics, tells every seam once (:meth:`forget` here) and routes the final output. (Up
to hookspec version 1 the processor called the resource manager itself; version 2 moved that
to the core.)

Call order per request: :meth:`add_request` once when it enters the engine; :meth:`process`
for every step that sampled a token for it, up to and including the step whose output reports
its finish; then :meth:`forget` exactly once, whatever ended it (a reported finish, an abort,
an error), after which the request is never passed again.

Invariants:
- Concatenating the ``new_text`` of every output of a request gives its final text exactly,
  and no delta ends inside a multi-byte character.
- At most one output per request reports a finish, and nothing follows it.
- A request is never reported finished before ``min_tokens`` outputs unless it hits
  ``max_tokens`` or ``max_model_len``.
- :meth:`process` writes only token bookkeeping (``output_token_ids``, ``first_token_time``),
  never ``status``, ``finish_reason`` or ``finished_time``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.outputs import RequestOutput, StepPlan, StepResult
    from fd_core.request import Request


class TokenProcessor(SeamPlugin, ABC):
    """Appends tokens, applies stops, detokenizes, and reports which requests finished."""

    def __init__(self, settings: BaseModel | None, *, tokenizer: object, max_model_len: int) -> None:
        """``tokenizer`` has ``decode(ids, skip_special_tokens)`` and ``convert_ids_to_tokens``."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Set up per-request state (detokenizer offsets, stop matcher) when it enters."""

    @abstractmethod
    def process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Consume one step's sampled tokens; return one output per request that got a token.

        An output whose ``finish_reason`` is set reports that the request finished (``stop`` or
        ``length``); the core ends it after this call.
        """

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop every trace of a request that ended (any reason); held-back text is discarded."""
