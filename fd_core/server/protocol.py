"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown-field policy: a field that is neither ours nor part of OpenAI's request schema is
rejected with 400 naming it, because silently ignoring a misspelt ``max_token`` would change
the answer without telling anyone. OpenAI fields that do not change the result here
(``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``parallel_tool_calls``, ``stream_options.include_obfuscation``) are
accepted and ignored. OpenAI fields whose meaning we cannot honour (``tools``,
``response_format`` other than text, a non-empty ``logit_bias``, ``suffix``, ``best_of``
other than ``n``, ``audio``...) are rejected with 400 naming the field. Beyond OpenAI we
accept vLLM's sampling extras: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, and
``stream_options.continuous_usage_stats`` (usage on every chunk); and vLLM's ``priority`` (an
integer in ``[MIN_PRIORITY, MAX_PRIORITY]``, default 0; lower runs first when a priority hook
plugin is installed, otherwise it changes nothing).

Types are strict: a value of the wrong JSON type is rejected with 400 naming the field, never
coerced (``"max_tokens": "8"``, ``"frequency_penalty": false``, a token id ``false``); an
integer is accepted where a number is expected (``"temperature": 1``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from fd_core.request import MAX_PRIORITY, MIN_PRIORITY
from fd_core.server.http_errors import FieldConflict

#: Most choices (``n``) one request may ask for.
MAX_N: Final = 128

#: Integers must fit the engine's wire format (msgpack int64) and numpy's seeding.
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
Count = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class _Body(BaseModel):
    # strict: no coercion ("8" for 8, false for 0, [[false]] for token 0); JSON integers still fill floats.
    # allow_inf_nan: pydantic's JSON parser accepts NaN and Infinity, which no sampler can use.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False   # vLLM: usage on every chunk
    include_obfuscation: StrictBool | None = None  # OpenAI; we never obfuscate


class _SamplingFields(_Body):
    """Fields the two endpoints share."""

    model: str | None = None   # None: the served model (OpenAI requires it; we do not)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: Count = 0
    stop_token_ids: list[Count] | None = None
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[str, float] | None = None
    priority: Priority = 0     # vLLM: scheduling priority, lower first (Request.priority), not a sampling field
    # OpenAI fields accepted and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldConflict("stream_options", "stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` may be text, token ids, or a list of either.

    ``max_tokens`` defaults to 16 as in OpenAI's API; an explicit null means "as many as fit".
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Count | None = None
    echo: StrictBool = False
    best_of: Count | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise FieldConflict("best_of", f"best_of ({self.best_of}) different from n ({self.n}) is not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise FieldConflict("content", f"a {self.role} message needs content (null is only allowed in an "
                                "assistant message)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. Without a token limit, the answer may fill the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: Count | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: StrictBool = True
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none"] | None = None
    modalities: list[Literal["text"]] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldConflict("top_logprobs", "top_logprobs requires logprobs to be true")
        return self
