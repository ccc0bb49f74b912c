"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown-field policy: a field that is neither ours nor part of OpenAI's request schema is
rejected with 400 naming it, because silently ignoring a misspelt ``max_token`` would change
the answer without telling anyone. OpenAI fields that do not change the result here
(``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``stream_options.include_obfuscation``) are accepted and ignored. OpenAI
fields whose meaning we cannot honour (``suffix``, ``best_of`` other than ``n``, ``audio``...)
are rejected with 400 naming the field. Beyond OpenAI we
accept vLLM's sampling extras: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, and
``stream_options.continuous_usage_stats`` (usage on every chunk); and vLLM's ``priority`` (an
integer in ``[MIN_PRIORITY, MAX_PRIORITY]``, default 0; lower runs first when a priority hook
plugin is installed, otherwise it changes nothing).

Constraints (guided decoding) on both endpoints: OpenAI's ``response_format`` (``json_object``,
``json_schema``), and for clients written against vLLM ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and the ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``). One constraint per
request: two are a 400 naming the second. ``logit_bias`` maps token ids (as strings, OpenAI's
form) to biases in [-100, 100] added to their logits.

Types are strict: a value of the wrong JSON type is rejected with 400 naming the field, never
coerced (``"max_tokens": "8"``, ``"frequency_penalty": false``, a token id ``false``); an
integer is accepted where a number is expected (``"temperature": 1``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from fd_core.errors import RequestError
from fd_core.request import MAX_PRIORITY, MIN_PRIORITY, GuidedDecoding
from fd_core.server.http_errors import FieldConflict
from fd_core.server.replies import tool_call_constraint

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


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's structured output. The schema is always enforced
    (``strict`` or not), so a reply always validates."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldConflict("json_schema", "json_schema is required with type json_schema, and only with it")
        return self

    def constraint(self) -> GuidedDecoding | None:
        if self.type == "json_object":
            return GuidedDecoding("json_object")
        if self.json_schema is not None:
            return GuidedDecoding("json", json.dumps(self.json_schema.schema_))
        return None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def constraint(self) -> tuple[str, GuidedDecoding] | None:
        given = [(name, value) for name, value in (("json", self.json_), ("regex", self.regex),
                                                   ("choice", self.choice), ("grammar", self.grammar),
                                                   ("json_object", self.json_object or None),
                                                   ("structural_tag", self.structural_tag)) if value is not None]
        if len(given) > 1:
            field = f"structured_outputs.{given[1][0]}"
            raise RequestError(field, f"{field}: one constraint per request, and {given[0][0]} already sets one")
        if not given:
            return None
        name, value = given[0]
        return f"structured_outputs.{name}", _constraint(name, value)


def _constraint(kind: str, value: Any) -> GuidedDecoding:
    """A constraint of ``kind`` from a body value (schemas, choices and tags may come as JSON values)."""
    if kind == "json_object":
        return GuidedDecoding("json_object")
    return GuidedDecoding(kind, value if isinstance(value, str) else json.dumps(value))


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
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None     # vLLM's extras
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: Priority = 0     # vLLM: scheduling priority, lower first (Request.priority), not a sampling field
    speculate: StrictBool = True   # ours: false opts the request out of speculative decoding (SamplingParams.speculate)
    # OpenAI fields accepted and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((key for key in value or () if not key.isdigit() or len(key) > 10), None)
        if bad is not None:
            raise ValueError(f"keys are token ids written as strings (\"1234\"), got {bad[:20]!r}")
        return value

    def token_biases(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    def constraint(self) -> tuple[str, GuidedDecoding] | None:
        """The one constraint of the body and the field it came in, or None."""
        given: list[tuple[str, GuidedDecoding]] = []
        if self.response_format is not None and (c := self.response_format.constraint()) is not None:
            given.append(("response_format", c))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if (value := getattr(self, name)) is not None:
                given.append((name, _constraint(kind, value)))
        if self.structured_outputs is not None and (found := self.structured_outputs.constraint()) is not None:
            given.append(found)
        if len(given) > 1:
            raise RequestError(given[1][0], f"{given[1][0]}: one constraint per request, and {given[0][0]} "
                               "already sets one")
        return given[0] if given else None

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


class FunctionSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str   # JSON text, as the model's earlier reply gave it


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: str | None = None   # an earlier reply's reasoning (templates that show it read it)

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise FieldConflict("content", f"a {self.role} message needs content (null is only allowed in an "
                                "assistant message)")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldConflict("tool_calls", "only an assistant message carries tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise FieldConflict("tool_call_id", "a tool message needs the tool_call_id of the call it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's shape: a call's arguments as an object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key):
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments(call.function.arguments)}}
                                     for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _arguments(text: str) -> Any:
    """A call's arguments as an object where they are a JSON object (templates write them with tojson)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. Without a token limit, the answer may fill the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: Count | None = None
    add_generation_prompt: StrictBool = True
    parallel_tool_calls: StrictBool | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extra template variables (enable_thinking...)
    modalities: list[Literal["text"]] | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldConflict("tools", "two tools have the same function name")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldConflict("tool_choice", f"names the function {self.tool_choice.function.name!r}, which is "
                                "not among tools")
        if self.tool_choice == "required" and not names:
            raise FieldConflict("tool_choice", "required needs tools")
        return self

    def constraint(self) -> tuple[str, GuidedDecoding] | None:
        """As for completions, and ``tool_choice`` ``required`` or a named function: JSON calls."""
        given = super().constraint()
        mode = self.tool_mode()
        if mode in (None, "none", "auto"):
            return given
        if given is not None:
            raise RequestError("tool_choice", f"tool_choice: {mode!r} constrains the reply to tool calls, and "
                               f"{given[0]} sets another constraint")
        tools = {tool.function.name: tool.function.parameters for tool in self.tools or ()}
        named = None if mode == "required" else mode
        return "tool_choice", tool_call_constraint(tools, named, parallel=self.parallel_tool_calls is not False)

    def template_variables(self) -> dict[str, Any]:
        """What the chat template gets beside the messages: ``tools`` (Hugging Face's shape) and
        ``chat_template_kwargs``."""
        variables = dict(self.chat_template_kwargs or {})
        reserved = sorted({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(variables))
        if reserved:
            raise RequestError("chat_template_kwargs", f"chat_template_kwargs: {', '.join(reserved)} are set by the "
                               "server, not by chat_template_kwargs")
        if self.tools:
            variables["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return variables

    def tool_mode(self) -> str | None:
        """``None`` (no tools), ``"none"``, ``"auto"``, ``"required"`` or the named function's name."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldConflict("top_logprobs", "top_logprobs requires logprobs to be true")
        return self


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a text, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: StrictBool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldConflict("prompt", "send prompt or messages (one of them)")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[Count]
