"""Accumulate a request's streamed deltas into its final result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fd_core.outputs import RequestMetrics, RequestOutput, SampledToken
    from fd_core.request import FinishReason


@dataclass(slots=True)
class CompletionResult:
    """The whole answer to one request, as ``LLM.generate`` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token from the second on; None when not asked
    prompt_logprobs: list[SampledToken] | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold one delta in; deltas must arrive in order."""
        assert not self.finished, f"delta after the final output of {self.request_id!r}"
        self.text += output.new_text
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.finished, self.finish_reason, self.error = True, output.finish_reason, output.error
            self.metrics = output.metrics

    def __repr__(self) -> str:
        return (f"CompletionResult(id={self.request_id!r}, tokens={len(self.token_ids)}, "
                f"finish_reason={self.finish_reason}, text={self.text[:40]!r}...)")
