"""Mistral tool calls, in both forms its tokenizers write.

* v3-v7 (Mistral 7B v0.3, Mixtral, Nemo, Small 3/3.1): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}`` objects (``id`` optional);
* v11+ (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``, once per call.

Text may come before the calls. A list is settled whole, once it closes: a list with any item that
is not a call is text. Mistral's templates refuse tool call ids that are not 9 letters or digits,
so the ids made here are such (:meth:`MistralToolParser.new_call_id`).

States: ``start`` (answer text, verbatim, until the tag), ``after_calls`` (whitespace after calls
is markup).
"""

from __future__ import annotations

import re
import secrets
import string
from typing import ClassVar, Final

from fd_core.contracts.tool_parser import FoundCall, ToolParser, ToolScan
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.text_scan import CONTENT, Span, json_value_end, leading_space, unsettled_tail
from fd_plugins.tool_parsers.json_calls import decode, read_call

TOOL_CALLS: Final = "[TOOL_CALLS]"
ARGS: Final = "[ARGS]"
START, AFTER_CALLS = "start", "after_calls"
#: A function name in the v11 form (what may stand between [TOOL_CALLS] and [ARGS]).
_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_CHARS: Final = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` calls, as a JSON list or as ``name[ARGS]{...}``."""

    name: ClassVar[str] = "mistral"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    markers = (TOOL_CALLS,)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Mistral templates with tools (they write ``[TOOL_CALLS]``)."""
        return TOOL_CALLS in template

    @classmethod
    def conformance_samples(cls) -> tuple[str, ...]:
        """Both forms, parallel calls, ids, text before the calls, a list with a non-call, unicode."""
        return (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
            '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}, "id": "Z9y8X7w6v"}]',
            'Je vérifie.[TOOL_CALLS][{"name": "search", "arguments": {"q": "crème brûlée"}}]\n',
            '[TOOL_CALLS][{"name": "ok", "arguments": {}}, {"arguments": {"no": "name"}}]',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"',
            'Plain answer, no tools.',
        )

    def new_call_id(self) -> str:
        """Nine random letters and digits, the only ids Mistral's templates accept."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def scan(self, text: str, state: str, *, final: bool) -> ToolScan:
        """See :meth:`ToolParser.scan`; the states are the module docstring's."""
        if state == AFTER_CALLS:
            space = leading_space(text)
            return ToolScan((space,), AFTER_CALLS) if space is not None else ToolScan((), START)
        index = text.find(TOOL_CALLS)
        if index == 0:
            return self._calls(text, final=final)
        end = index if index > 0 else len(text) if final else unsettled_tail(text, (TOOL_CALLS,))
        return ToolScan((Span(CONTENT, text[:end]),) if end else (), START)

    def _calls(self, text: str, *, final: bool) -> ToolScan:
        """``text`` starts with ``[TOOL_CALLS]``: the calls once complete (text when they are not calls)."""
        start = len(TOOL_CALLS)
        body = start + len(text[start:]) - len(text[start:].lstrip())
        if body < len(text) and text[body] == "[":
            return self._list(text, body, final=final)
        name = _NAME.match(text, body)
        assert name is not None, "the pattern matches the empty string"
        if name.group() and text.startswith(ARGS, name.end()):
            return self._named(text, name.group(), name.end() + len(ARGS), final=final)
        if not final and ARGS.startswith(text[name.end():]):
            return ToolScan((), START)   # the list, or the name and [ARGS], may be arriving
        return ToolScan((Span(CONTENT, text[:body]),), START)

    def _list(self, text: str, start: int, *, final: bool) -> ToolScan:
        """v3-v7: the JSON list opening at ``text[start]``."""
        end = json_value_end(text, start)
        if end is None:
            return ToolScan((Span(CONTENT, text),), START) if final else ToolScan((), START)
        items = decode(text[start:end])
        calls = [read_call(item, ("arguments",)) for item in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return ToolScan((Span(CONTENT, text[:end]),), START)
        cuts = _item_ends(text, start, end)
        pieces = []
        for (name, arguments), item, begin, cut in zip(calls, items, [0, *cuts[:-1]], cuts, strict=True):
            written = item.get("id")
            pieces.append(FoundCall(name, arguments, text[begin:cut], written if isinstance(written, str) and written
                                    else None))
        return ToolScan(tuple(pieces), AFTER_CALLS)

    def _named(self, text: str, name: str, start: int, *, final: bool) -> ToolScan:
        """v11: ``[TOOL_CALLS]name[ARGS]`` then the arguments object opening at ``text[start]``."""
        if start < len(text) and text[start] != "{":
            return ToolScan((Span(CONTENT, text[:start]),), START)
        end = json_value_end(text, start) if start < len(text) else None
        if end is None:
            return ToolScan((Span(CONTENT, text),), START) if final else ToolScan((), START)
        call = read_call({"name": name, "arguments": decode(text[start:end])}, ("arguments",))
        if call is None:
            return ToolScan((Span(CONTENT, text[:end]),), START)
        return ToolScan((FoundCall(*call, text=text[:end]),), AFTER_CALLS)


def _item_ends(text: str, start: int, end: int) -> list[int]:
    """Where each item of the (valid) JSON list ``text[start:end]`` ends, with the comma after it; the
    last one ends with the list."""
    ends = []
    index = start + 1
    while True:
        index += len(text[index:end]) - len(text[index:end].lstrip())
        item_end = json_value_end(text, index)
        assert item_end is not None, "the list decoded, so its items close"
        after = item_end + len(text[item_end:end]) - len(text[item_end:end].lstrip())
        if text[after] == "]":
            return [*ends, end]
        ends.append(after + 1)   # the comma
        index = after + 1
