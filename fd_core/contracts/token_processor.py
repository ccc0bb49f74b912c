"""Contract of the TokenProcessor seam: turns sampled tokens into request outputs.

Called once per step after the model ran: :meth:`TokenProcessor.process` appends each sampled
token to its request, checks the stop conditions, detokenizes incrementally, attaches
logprobs and metrics, and tells the resource manager which requests finished (so their blocks
are freed before the next step is planned).

Invariants:
- Concatenating the ``new_text`` of every output of a request gives its final text exactly,
  and no delta ends inside a multi-byte character.
- Exactly one output per request has ``finished=True``, and it is the last one.
- A request is never finished before ``min_tokens`` outputs unless it hits ``max_tokens``,
  ``max_model_len`` or is aborted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.contracts.resource_manager import ResourceManager
    from fd_core.outputs import RequestOutput, StepPlan, StepResult
    from fd_core.request import FinishReason, Request


class TokenProcessor(SeamPlugin, ABC):
    """Appends tokens, applies stops, detokenizes, and reports finished requests."""

    def __init__(self, settings: BaseModel | None, *, tokenizer: object,
                 resource_manager: ResourceManager, max_model_len: int) -> None:
        """``tokenizer`` has ``decode(ids, skip_special_tokens)`` and ``convert_ids_to_tokens``."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.resource_manager = resource_manager
        self.max_model_len = max_model_len

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Set up per-request state (detokenizer offsets, stop matcher) when it enters."""

    @abstractmethod
    def process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Consume one step's sampled tokens; return one output per request that changed."""

    @abstractmethod
    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Finish a request from outside the step (abort, expiry, error) and return its last output."""
