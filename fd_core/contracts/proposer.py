"""Contract of the proposer seam (speculative decoding): guesses the next tokens of running requests.

Each step, before planning, the engine core asks the selected proposer for up to ``budget`` next
tokens of every request that decodes (its prompt and outputs are computed but for the last
token) and allows speculation (``SamplingParams.speculate`` and the sampling it supports). It sets
them as the request's ``spec_token_ids``; the resource manager plans them with the request's
last token (they count against the step's token budget), the runner computes them in the same
forward pass and checks them against the model: a greedy request keeps the longest prefix equal
to the model's own choices, a sampled one decides each by rejection sampling, so that its output
distribution is exactly the model's. Either way one more token (the model's at the first rejected
position, or after the last accepted one) comes from that pass. The K/V of rejected positions is
rolled back (``num_computed_tokens``), and their blocks are reused by the next steps.

A proposal never changes what a request outputs, only how many passes it takes: a proposer that
proposes badly costs speed, never correctness. Call order per request: :meth:`Proposer.propose`
on steps where it decodes (not necessarily every step), :meth:`Proposer.observe` after each step
that verified its proposal, and :meth:`Proposer.forget` once when it ends (any reason). A request
may arrive with outputs already (a continuation, a preempted request): a proposer rebuilds what
it keeps from ``prompt_token_ids`` and ``output_token_ids``, never from what it saw before.

Invariants the engine relies on (``fd_core.testing.conformance.check_proposer`` checks them):
- One list per request, in order, at most its budget long; every id a Python ``int`` in
  ``[0, vocab_size)``.
- The same calls give the same proposals; without :meth:`Proposer.observe` in between, what it
  proposes for a request depends on the request's tokens alone, however they came.
- :meth:`Proposer.propose`, :meth:`Proposer.observe` and :meth:`Proposer.forget` leave the requests
  as they were (the engine core sets ``spec_token_ids`` from the answer); ``observe`` and
  ``forget`` take requests never proposed for, or forgotten already.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.model.kernels import KernelSet
    from fd_core.request import Request


@dataclass(frozen=True, slots=True)
class ModelRuntime:
    """How the engine runs its model on this machine, for a proposer that runs a model of its own."""

    kernels: KernelSet   # the kernels the platform's capabilities chose
    device: str          # the paddle device, e.g. "cpu"
    dtype: str           # model.dtype


class Proposer(SeamPlugin, ABC):
    """Proposes draft tokens for the engine to verify (``fd.proposers``)."""

    def __init__(self, settings: BaseModel | None, *, max_proposed_tokens: int, vocab_size: int,
                 runtime: ModelRuntime | None = None) -> None:
        """``max_proposed_tokens`` is ``proposer.num_speculative_tokens``, the most any request gets
        per step; ``vocab_size`` bounds the token ids it may propose; ``runtime`` is how the engine
        runs its model (None outside an engine, e.g. in the conformance kit: the portable kernels on
        the CPU)."""
        self.settings = settings
        self.max_proposed_tokens = max_proposed_tokens
        self.vocab_size = vocab_size
        self.runtime = runtime

    @abstractmethod
    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        """For each request, at most ``budgets[i]`` (>= 1, <= ``max_proposed_tokens``) token ids,
        each in ``[0, vocab_size)``, that it guesses follow ``requests[i]``'s prompt and outputs; an
        empty list proposes nothing for it this step. Called on the engine thread: keep it cheap
        beside a forward pass."""

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """How many of the ``num_proposed`` tokens the runner computed for ``request`` it accepted
        (a proposal cut by the step's token budget counts what was computed). Default: nothing."""

    def forget(self, request_id: str) -> None:
        """Drop any state kept for a request that ended. Default: nothing."""
