"""Calls written as one JSON object each between an opening and a closing tag (``<tool_call>``).

States: ``start`` — nothing but calls and whitespace so far (whitespace here is markup); ``text``
— answer text, verbatim. A tag opens a call; the call settles once its closing tag arrives: a
valid object (``fd_plugins.tool_parsers.json_calls.read_call``) is a call, anything else is text,
tags included (see ``TaggedJsonToolParser._call``). An unclosed call at the end of the reply is text.
"""

from __future__ import annotations

from typing import ClassVar, Final

from fd_core.contracts.tool_parser import FoundCall, ToolParser, ToolScan
from fd_core.text_scan import CONTENT, Span, begins_with, json_value_end, leading_space, unsettled_tail
from fd_plugins.tool_parsers.json_calls import decode, read_call

START: Final = "start"
TEXT: Final = "text"


class TaggedJsonToolParser(ToolParser):
    """Base of the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` families."""

    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"
    markers = (open_tag, close_tag)
    #: Whether a call may follow answer text; when not, a tag after text is text.
    calls_after_text: ClassVar[bool] = True

    def scan(self, text: str, state: str, *, final: bool) -> ToolScan:
        """See :meth:`ToolParser.scan`; states ``start`` and ``text`` (module docstring)."""
        if state == START:
            space = leading_space(text)
            if space is not None:
                return ToolScan((space,), START)
            opens = begins_with(text, self.open_tag, final=final)
            if opens is None:
                return ToolScan((), START)      # the tag may be arriving
            return self._call(text, final=final) if opens else ToolScan((), TEXT)
        if not self.calls_after_text:
            return ToolScan((Span(CONTENT, text),), TEXT)
        index = text.find(self.open_tag)
        if index == 0:
            return ToolScan((), START)
        end = index if index > 0 else len(text) if final else unsettled_tail(text, (self.open_tag,))
        return ToolScan((Span(CONTENT, text[:end]),) if end else (), START if index > 0 else TEXT)

    def _call(self, text: str, *, final: bool) -> ToolScan:
        """``text`` starts with the opening tag: the call once it is closed.

        The call's JSON object ends where its brackets balance (a closing tag inside a string does
        not end it) and the closing tag must follow. A body that is not such an object ends at the
        first closing tag, and is text; so is a call still open when the reply ends.
        """
        start = len(self.open_tag)
        body = start + len(text[start:]) - len(text[start:].lstrip())
        if body < len(text) and text[body] == "{":
            end = json_value_end(text, body)
            if end is not None:
                after = end + len(text[end:]) - len(text[end:].lstrip())
                if text.startswith(self.close_tag, after):
                    end = after + len(self.close_tag)
                    call = read_call(decode(text[start:after]), ("arguments",))
                    if call is None:
                        return ToolScan((Span(CONTENT, text[:end]),), TEXT)
                    return ToolScan((FoundCall(*call, text=text[:end]),), START)
                if self.close_tag.startswith(text[after:]) and not final:
                    return ToolScan((), START)   # the closing tag may be arriving
            elif not final:
                return ToolScan((), START)
        close = text.find(self.close_tag, start)
        if close < 0:
            return ToolScan((Span(CONTENT, text),), TEXT) if final else ToolScan((), START)
        return ToolScan((Span(CONTENT, text[:close + len(self.close_tag)]),), TEXT)
