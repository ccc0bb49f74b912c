"""ERNIE 4.5 tool calls (the thinking models, after their reasoning).

ERNIE writes calls like Hermes (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
newlines around the JSON, a blank line or two before the first), with its own habits: a call
to a function without parameters may leave ``arguments`` out (``{}``), and a reply is either an
answer or calls: a ``<tool_call>`` after answer text is part of the text (the model quoting the
format), never a call.
"""

from __future__ import annotations

from typing import ClassVar, Final

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.tool_parsers.tagged import TaggedJsonToolParser

#: Strings only ERNIE's chat templates hold (its sentence tokens, its answer tag).
ERNIE_TEMPLATE_MARKS: Final = ("<|begin_of_sentence|>", "<|end_of_sentence|>", "<response>")


class ErnieToolParser(TaggedJsonToolParser):
    """ERNIE's ``<tool_call>`` JSON calls, only where the reply starts with them."""

    name: ClassVar[str] = "ernie"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    calls_after_text = False
    template_priority = 1   # its templates also hold the tag hermes looks for

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """ERNIE templates that describe ``<tool_call>`` calls."""
        return cls.open_tag in template and any(mark in template for mark in ERNIE_TEMPLATE_MARKS)

    @classmethod
    def conformance_samples(cls) -> tuple[str, ...]:
        """ERNIE-style replies: parallel calls, a call without arguments, text that quotes a call."""
        return (
            '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "北京", "unit": "c"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "list_items"}\n</tool_call>\n',
            'The format is <tool_call>{"name": "x", "arguments": {}}</tool_call>, shown as text.',
            '<tool_call>\n{"name": "get_weather", "arguments": {"location": "上海"\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"location": "广州"}}',
        )
