"""Helper of the reasoning-parser tests: a reply streamed in given deltas."""

from __future__ import annotations

from fd_core.contracts.reasoning_parser import ReasoningParser, ReasoningText


def streamed(parser: ReasoningParser, deltas: list[str], prompt: str = "") -> list[ReasoningText]:
    """What each delta settled, then what finish() settled."""
    stream = parser.stream(prompt=prompt)
    return [stream.feed(delta) for delta in deltas] + [stream.finish()]


def joined(results: list[ReasoningText]) -> ReasoningText:
    return ReasoningText("".join(r.reasoning for r in results), "".join(r.content for r in results))
