"""The ``draft`` proposer: a small model of the same vocabulary guesses the next tokens greedily.

It runs its own :class:`~fd_core.runner.model_runner.ModelRunner` (the engine's own model code and
kernels) over its own paged KV pool of ``num_blocks`` blocks. Per step, for the requests asked about:

1. **Catch up**: one batched pass computes, per request, the tokens the draft has not computed yet
   (all of them the first time: the prompt; afterwards the tokens the target accepted and the one it
   added). What it computed before stays valid as far as its own tokens agree with the request's
   (the accepted prefix of its last proposal), so a rejected guess costs only its positions, and a
   request that arrives with outputs (a continuation) is simply caught up from its tokens.
2. **Draft**: the argmax of that pass is the first guess; each further guess is one batched decode
   pass over the requests still drafting, up to each one's budget. With ``adaptive`` (the default)
   that budget follows the request's acceptance as for ``ngram`` (``fd_plugins.proposers.adaptive``):
   a request whose guesses keep failing is asked for fewer, then none (the draft then skips it,
   and catches up when it is asked again).

A request the pool has no room for gets no proposal this step (it decodes normally); the blocks of
a request are freed by :meth:`DraftProposer.forget`. The draft must share the target's tokenizer:
a model whose vocabulary size differs is refused at start-up, naming ``proposer.options.model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.proposer import Proposer
from fd_core.errors import ConfigError
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import ScheduledRequest, StepPlan
from fd_core.request import Request, SamplingParams
from fd_plugins.proposers.adaptive import AdaptiveBudget

if TYPE_CHECKING:
    from fd_core.contracts.proposer import ModelRuntime


class DraftSettings(BaseModel):
    """``[proposer.options]`` of ``draft``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The draft model: an alias, a Hugging Face folder or a .gguf file, with the "
                                   "target's vocabulary (the same tokenizer).")
    num_blocks: int = Field(256, ge=1, description="KV blocks of the draft's own pool.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block of the draft's pool.")
    adaptive: bool = Field(True, description=(
        "Ask each request for fewer guesses while they are rejected, then none (with a one-token probe every "
        "few steps), as ngram does (fd_plugins/proposers/adaptive.py)."))


@dataclass(slots=True)
class _Drafted:
    """What the draft holds for one request: its blocks and the tokens whose K/V they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)   # those the draft computed (or is computing), in order
    known: int = 0   # how many of ``tokens`` came from the request (the rest are its guesses)
    budget: AdaptiveBudget | None = None   # None: not adaptive


_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer(Proposer):
    """Greedy guesses of a small model run beside the target (see the module docstring)."""

    name: ClassVar[str] = "draft"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = DraftSettings

    def __init__(self, settings: DraftSettings | None, *, max_proposed_tokens: int, vocab_size: int,
                 runtime: ModelRuntime | None = None) -> None:
        if settings is None:
            raise ConfigError("proposer.options.model", "the draft proposer needs the draft model's source")
        super().__init__(settings, max_proposed_tokens=max_proposed_tokens, vocab_size=vocab_size, runtime=runtime)
        from fd_core.model.kernels import PORTABLE_KERNELS
        from fd_core.model.loader import load_model
        from fd_core.runner.model_runner import ModelRunner
        from fd_core.runner.sampling import Sampler

        loaded = load_model(settings.model)
        if loaded.arch.vocab_size != vocab_size:
            raise ConfigError("proposer.options.model", f"the draft model {settings.model!r} has a vocabulary of "
                              f"{loaded.arch.vocab_size} tokens, the served model {vocab_size}: a draft must "
                              "share the served model's tokenizer")
        self.runner = ModelRunner(loaded.architecture, loaded.arch, loaded.weights, num_blocks=settings.num_blocks,
                                  block_size=settings.block_size, sampler=Sampler(),
                                  release_weights=loaded.weights.clear,   # built: the load-time arrays go first
                                  **({"kernels": runtime.kernels, "device": runtime.device, "dtype": runtime.dtype}
                                     if runtime is not None else {"kernels": PORTABLE_KERNELS}))
        self.block_size = settings.block_size
        self._free = list(range(settings.num_blocks - 1, -1, -1))   # pop() hands out the lowest id first
        self._drafted: dict[str, _Drafted] = {}

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        shadows: dict[int, Request] = {}   # index -> a request over the draft's tokens (``_Drafted.tokens``)
        rows: list[ScheduledRequest] = []
        budgets = list(budgets)
        for i, request in enumerate(requests):
            drafted = self._drafted.get(request.request_id)
            if drafted is None:
                drafted = self._drafted[request.request_id] = _Drafted(
                    budget=AdaptiveBudget(self.max_proposed_tokens) if self.settings.adaptive else None)
            if drafted.budget is not None:
                budgets[i] = drafted.budget.allow(budgets[i])
            if not budgets[i]:
                continue
            tokens = request.all_token_ids
            # what it computed holds as far as its tokens agree with the request's: those it took from the
            # request (unless they changed, as for a request id reused), then its guesses
            known = drafted.known if drafted.tokens[:drafted.known] == tokens[:drafted.known] else 0
            agree = known + _common_prefix(drafted.tokens[known:], tokens[known:])
            start = min(agree, len(tokens) - 1)   # the last token's pass gives the first guess
            if not self._hold(drafted, len(tokens) + budgets[i] - 1):
                continue
            drafted.tokens[start:] = tokens[start:]
            drafted.known = len(tokens)
            shadows[i] = Request(request.request_id, drafted.tokens, sampling_params=_GREEDY)
            rows.append(ScheduledRequest(shadows[i], start, len(tokens) - start, drafted.blocks, sample=True))
        while rows:
            sampled = self.runner.execute(StepPlan(rows)).sampled
            rows = []
            for i, shadow in shadows.items():
                guess = sampled.get(shadow.request_id)
                if guess is None or len(proposals[i]) == budgets[i]:
                    continue
                proposals[i].append(guess.token_id)
                if len(proposals[i]) < budgets[i]:   # one more pass, over this guess, for the next one
                    shadow.prompt_token_ids.append(guess.token_id)   # the draft's token list
                    rows.append(ScheduledRequest(shadow, shadow.num_prompt_tokens - 1, 1,
                                                 self._drafted[shadow.request_id].blocks, sample=True))
        return proposals

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        drafted = self._drafted.get(request.request_id)
        if drafted is not None and drafted.budget is not None:
            drafted.budget.observe(num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        drafted = self._drafted.pop(request_id, None)
        if drafted is not None:
            self._free.extend(reversed(drafted.blocks))
        self.runner.release([request_id])

    def _hold(self, drafted: _Drafted, num_tokens: int) -> bool:
        """Give ``drafted`` blocks for ``num_tokens`` tokens; False (taking none) when the pool is short."""
        missing = -(-num_tokens // self.block_size) - len(drafted.blocks)
        if missing > len(self._free):
            return False
        drafted.blocks.extend(self._free.pop() for _ in range(max(missing, 0)))
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
