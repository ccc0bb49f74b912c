"""Chat replies shaped as OpenAI messages: reasoning split off, tool calls read out, whole or streamed.

A :class:`ReplyShape` belongs to one chat request. It knows how the reply's text becomes a message:

- a reasoning parser (chosen by the model's chat template, ``[reasoning_parser]``) moves the
  model's thinking into ``reasoning_content``;
- with ``tools`` and ``tool_choice`` ``auto``, a tool parser (``[tool_parser]``) reads the calls
  the model wrote in its own format out of the answer;
- with ``tool_choice`` ``required`` or a named function, the reply's answer (after any reasoning) was
  constrained to JSON (:func:`tool_call_constraint`) and every call is read from that JSON; nothing
  is content.

:meth:`ReplyShape.message` shapes a whole reply; :meth:`ReplyShape.stream` gives a per-choice
:class:`ReplyStream` whose deltas concatenate to the same message.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fd_core.contracts.tool_parser import ToolCall, ToolCallDelta
from fd_core.request import GuidedDecoding

if TYPE_CHECKING:
    from fd_core.contracts.reasoning_parser import ReasoningParser, ReasoningStream
    from fd_core.contracts.tool_parser import ToolCallStream, ToolParser

#: tool_choice values that constrain the reply to calls (a named function is the fourth mode).
REQUIRED, AUTO, NONE = "required", "auto", "none"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call_constraint(tools: dict[str, dict[str, Any] | None], named: str | None, *,
                         parallel: bool) -> GuidedDecoding:
    """The JSON a reply must be when calls are required (``tools``: function name -> its parameters'
    schema): a named function's arguments object, or a list of ``{"name", "parameters"}`` calls (one
    call unless ``parallel``)."""
    def parameters(name: str) -> dict[str, Any]:
        return tools[name] or {"type": "object"}

    if named is not None:
        return GuidedDecoding("json", json.dumps(parameters(named)))
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters(name)},
              "required": ["name", "parameters"], "additionalProperties": False} for name in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return GuidedDecoding("json", json.dumps(schema))


@dataclass(slots=True)
class ReplyShape:
    """How one request's replies become messages (see the module docstring)."""

    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None      # set for tool_choice auto with tools
    required_calls: bool = False               # tool_choice required: the reply is a JSON list of calls
    named_function: str | None = None          # tool_choice names a function: the reply is its arguments
    prompt: str = ""                           # the rendered prompt (a template may open <think> in it)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The message fields of a whole reply (``content``, ``reasoning_content``, ``tool_calls``) and
        whether it holds calls."""
        stream = self.stream()
        parts = [stream.feed(text), stream.finish()]
        merged: dict[str, Any] = {"content": None}
        for part in parts:
            for key in ("content", "reasoning_content"):
                if part.get(key):
                    merged[key] = (merged.get(key) or "") + part[key]
            if part.get("tool_calls"):
                merged.setdefault("tool_calls", []).extend(
                    {k: v for k, v in call.items() if k != "index"} for call in part["tool_calls"])
        if merged["content"] is None and "tool_calls" not in merged:
            merged["content"] = ""
        return merged, bool(stream.calls)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


@dataclass(slots=True)
class ReplyStream:
    """One choice's streamed reply: each :meth:`feed` gives a delta's message fields."""

    shape: ReplyShape
    calls: int = 0
    _reasoning: ReasoningStream | None = None
    _tools: ToolCallStream | None = None
    _json: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shape.reasoning_parser is not None:
            self._reasoning = self.shape.reasoning_parser.stream(prompt=self.shape.prompt)
        if self.shape.tool_parser is not None:
            self._tools = self.shape.tool_parser.stream(new_id=new_call_id)

    def feed(self, text: str) -> dict[str, Any]:
        """The delta's fields for ``text``, the next piece of the reply."""
        if self._reasoning is None:
            return self._answer("", text, final=False)
        split = self._reasoning.feed(text)
        return self._answer(split.reasoning, split.content, final=False)

    def finish(self) -> dict[str, Any]:
        """What the reply's end settles (text held back to see whether a tag or a call follows)."""
        if self._reasoning is None:
            return self._answer("", "", final=True)
        split = self._reasoning.finish()
        return self._answer(split.reasoning, split.content, final=True)

    def _answer(self, reasoning: str, content: str, *, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[ToolCallDelta] = []
        if self.shape.required_calls or self.shape.named_function is not None:
            self._json.append(content)
            content = ""
            if final:
                text = "".join(self._json)
                calls = self._json_calls(text)
                content = "" if calls else text   # cut off (max_tokens): the text, not a made-up call
        elif self._tools is not None:
            parsed = self._tools.feed(content) if content else None
            content = parsed.content if parsed else ""
            calls = list(parsed.tool_calls) if parsed else []
            if final:
                rest = self._tools.finish()
                content += rest.content
                calls += rest.tool_calls
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
            self.calls += len(calls)
        return delta

    def _json_calls(self, text: str) -> list[ToolCallDelta]:
        """The calls of a constrained reply (a cut-off reply that does not parse has none)."""
        try:
            value = json.loads(text)
        except ValueError:
            return []
        if self.shape.named_function is not None:
            found = [(self.shape.named_function, value)]
        else:
            found = [(call["name"], call["parameters"]) for call in value]
        return [ToolCallDelta(i, ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False)))
                for i, (name, arguments) in enumerate(found)]
