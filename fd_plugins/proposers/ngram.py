"""The ``ngram`` proposer (prompt lookup): a request's next tokens are guessed from its own tokens.

For each request it takes the last ``n`` tokens of the prompt and outputs, ``n`` from ``max_n``
down to ``min_n``, finds the most recent earlier occurrence of that n-gram and proposes the
tokens that followed it (``fd_plugins.proposers.prompt_lookup``); nothing when none occurs. It
pays off where the output repeats its input (summaries, edits, code, extraction) and costs almost
nothing where it does not. With ``adaptive`` (the default) each request proposes fewer tokens
while its proposals keep being rejected, none for a while when they fail often, and the whole
budget again once they pass (``fd_plugins.proposers.adaptive`` states the rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fd_core.contracts.proposer import Proposer
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.proposers.adaptive import AdaptiveBudget
from fd_plugins.proposers.prompt_lookup import SeenTokens, continuation

if TYPE_CHECKING:
    from fd_core.contracts.proposer import ModelRuntime
    from fd_core.request import Request

#: Longest n-gram an option may name: each length is one more vectorised comparison per request.
MAX_NGRAM: Final = 16


class NgramSettings(BaseModel):
    """``[proposer.options]`` of the ngram proposer."""

    model_config = ConfigDict(extra="forbid")

    min_n: int = Field(2, ge=1, le=MAX_NGRAM, description=(
        "Shortest suffix matched: a request whose last min_n tokens occur nowhere earlier gets no proposal."))
    max_n: int = Field(4, ge=1, le=MAX_NGRAM, description=(
        "Longest suffix matched; a longer match is taken over a more recent shorter one."))
    adaptive: bool = Field(True, description=(
        "Shrink a request's proposals while they are rejected (down to none, with a one-token probe every "
        "few steps) and grow them back while they pass; false: always propose up to the step's budget."))

    @field_validator("max_n")
    @classmethod
    def _not_below_min_n(cls, value: int, info: ValidationInfo) -> int:
        min_n = info.data.get("min_n")
        if min_n is not None and value < min_n:
            raise ValueError(f"must be at least min_n ({min_n}), got {value}")
        return value


@dataclass(slots=True)
class _RequestState:
    """What the proposer keeps for one request until it is forgotten."""

    tokens: SeenTokens = field(default_factory=SeenTokens)
    budget: AdaptiveBudget | None = None   # None: not adaptive


class NgramProposer(Proposer):
    """Prompt lookup over each request's prompt and outputs (see the module)."""

    name: ClassVar[str] = "ngram"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = NgramSettings

    def __init__(self, settings: BaseModel | None, *, max_proposed_tokens: int, vocab_size: int,
                 runtime: ModelRuntime | None = None) -> None:
        super().__init__(settings, max_proposed_tokens=max_proposed_tokens, vocab_size=vocab_size, runtime=runtime)
        self.options = settings if isinstance(settings, NgramSettings) else NgramSettings()
        self._requests: dict[str, _RequestState] = {}

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        """Each request's lookup, cut to its budget (and, when adaptive, to what its acceptance allows)."""
        return [self._propose_one(request, budget) for request, budget in zip(requests, budgets, strict=True)]

    def _propose_one(self, request: Request, budget: int) -> list[int]:
        state = self._requests.get(request.request_id)
        if state is None:
            adaptive = AdaptiveBudget(self.max_proposed_tokens) if self.options.adaptive else None
            state = self._requests[request.request_id] = _RequestState(budget=adaptive)
        allowed = budget if state.budget is None else state.budget.allow(budget)
        if not allowed:   # paused: its tokens are caught up on the next call that proposes
            return []
        return continuation(state.tokens.sync(request), min_n=self.options.min_n, max_n=self.options.max_n,
                            budget=allowed)

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Feeds the request's acceptance estimate (adaptive only); a request it does not know is ignored."""
        state = self._requests.get(request.request_id)
        if state is not None and state.budget is not None:
            state.budget.observe(num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        """Drops the request's tokens and estimate (nothing when it holds none)."""
        self._requests.pop(request_id, None)
