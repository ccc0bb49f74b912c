"""Hermes-style tool calls, as Hermes 2/3, Qwen2.5 and Qwen3 write them.

One ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call, several in a row for
parallel calls, answer text before and after them.
"""

from __future__ import annotations

from typing import ClassVar

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.tool_parsers.tagged import TaggedJsonToolParser


class HermesToolParser(TaggedJsonToolParser):
    """``<tool_call>`` JSON calls anywhere in the reply."""

    name: ClassVar[str] = "hermes"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Templates that tell the model to answer in ``<tool_call>`` tags (Hermes, Qwen2.5, Qwen3)."""
        return cls.open_tag in template

    @classmethod
    def conformance_samples(cls) -> tuple[str, ...]:
        """Qwen-style replies: one call, parallel calls, text around them, unicode, a malformed call."""
        return (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
            'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>\n'
            'Done — 完成.',
            '<tool_call>\n{"name": "search", "arguments": {"q": "a </tool_call> b"}}\n</tool_call>',
            '<tool_call>\n{"name": "broken", "arguments": {"x": 1}\n</tool_call>\nthen text',
            'No tools needed: 2 + 2 = 4.',
        )
