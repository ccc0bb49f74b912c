"""Helpers of the tool-parser tests: a reply streamed in given deltas, with ids from a counter."""

from __future__ import annotations

import itertools

from fd_core.contracts.tool_parser import ToolCallDelta, ToolParser


def counter_ids():
    """A deterministic id factory: call_0, call_1, ..."""
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def streamed(parser: ToolParser, deltas: list[str]) -> tuple[list[str], list[ToolCallDelta]]:
    """Each delta's content (then finish()'s), and every call delta, in order."""
    stream = parser.stream(new_id=counter_ids())
    results = [stream.feed(delta) for delta in deltas] + [stream.finish()]
    return [r.content for r in results], [call for r in results for call in r.tool_calls]
