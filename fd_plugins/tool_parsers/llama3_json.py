"""Llama 3.1-3.3 JSON tool calls.

The reply is the calls: ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is read too),
several separated by ``;`` (or whitespace), optionally after ``<|python_tag|>``. The tag may also
follow answer text (``Let me look that up.<|python_tag|>{...}``). A reply that starts with anything
else is text, and so is everything from the first object that is not a call.

States: ``start`` (the reply's start: a call may begin), ``calls`` (after the tag or a ``;``: a
call is expected), ``after_call`` (a ``;``, another call or the end may follow), ``text``.
"""

from __future__ import annotations

from typing import ClassVar, Final

from fd_core.contracts.tool_parser import FoundCall, ToolParser, ToolScan
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.text_scan import CONTENT, MARKUP, Span, begins_with, json_value_end, leading_space, unsettled_tail
from fd_plugins.tool_parsers.json_calls import decode, read_call

PYTHON_TAG: Final = "<|python_tag|>"
SEPARATOR: Final = ";"
START, CALLS, AFTER_CALL, TEXT = "start", "calls", "after_call", "text"


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls at the start of the reply or after ``<|python_tag|>``."""

    name: ClassVar[str] = "llama3_json"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    markers = (PYTHON_TAG, SEPARATOR)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Llama 3 templates with tool calling (``<|python_tag|>``, or the JSON ``parameters`` prompt)."""
        return PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template)

    @classmethod
    def conformance_samples(cls) -> tuple[str, ...]:
        """Llama-style replies: a call, parallel calls, the tag after text, a non-call object, unicode."""
        return (
            '{"name": "get_weather", "parameters": {"city": "São Paulo"}}',
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {"tz": "Europe/Oslo"}}',
            'Let me look that up.<|python_tag|>{"name": "search", "arguments": {"q": "llama; \\"3\\""}}',
            '{"result": 42} is the JSON you asked for.',
            '{"name": "get_weather", "parameters": {"city": "Lima"',
            'The answer is 7; no tool needed.',
        )

    def scan(self, text: str, state: str, *, final: bool) -> ToolScan:
        """See :meth:`ToolParser.scan`; the states are the module docstring's."""
        if state == TEXT:
            index = text.find(PYTHON_TAG)
            if index == 0:
                return ToolScan((Span(MARKUP, PYTHON_TAG),), CALLS)
            end = index if index > 0 else len(text) if final else unsettled_tail(text, (PYTHON_TAG,))
            return ToolScan((Span(CONTENT, text[:end]),) if end else (), TEXT)
        space = leading_space(text)
        if space is not None:
            return ToolScan((space,), state)
        if text.startswith("{"):
            return self._call(text, final=final)
        if state == AFTER_CALL and text.startswith(SEPARATOR):
            return ToolScan((Span(MARKUP, SEPARATOR),), CALLS)
        tagged = begins_with(text, PYTHON_TAG, final=final) if state != CALLS else False
        if tagged is None:
            return ToolScan((), state)           # the tag may be arriving
        return ToolScan((Span(MARKUP, PYTHON_TAG),), CALLS) if tagged else ToolScan((), TEXT)

    def _call(self, text: str, *, final: bool) -> ToolScan:
        """``text`` starts with ``{``: a call once the object closes; text when it is not one."""
        end = json_value_end(text, 0)
        if end is None:
            return ToolScan((Span(CONTENT, text),), TEXT) if final else ToolScan((), CALLS)
        call = read_call(decode(text[:end]), ("parameters", "arguments"))
        if call is None:
            return ToolScan((Span(CONTENT, text[:end]),), TEXT)
        return ToolScan((FoundCall(*call, text=text[:end]),), AFTER_CALL)
