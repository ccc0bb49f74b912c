"""Reading a model's text as it streams in: the pieces a parser settles, and the loop that asks for them.

The tool-call and reasoning parsers (``fd_core/contracts/tool_parser.py``, ``reasoning_parser.py``)
are written as *scanners*: given the text not yet settled and the state the text left them in,
a scanner settles a prefix of it into pieces (content, reasoning, markup such as ``<think>``, or a
tool call) and names the state after them. :func:`drain` asks again until nothing more settles, so
a parser's whole parse and its streaming parse are the same function, and streaming in any split
gives the same result as parsing the whole text, as long as the scanner settles only what no later
text could change. The helpers below find what is not settled yet: a marker split across deltas
(``"</th"``), a JSON object still open.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

#: Span kinds: text the client gets as the answer, as the reasoning, or never (tags, and the
#: whitespace next to them).
CONTENT: Final = "content"
REASONING: Final = "reasoning"
MARKUP: Final = "markup"
#: Scans in a row that settle nothing yet change the state before :func:`drain` calls it a loop.
MAX_IDLE_SCANS: Final = 8


@dataclass(frozen=True, slots=True)
class Span:
    """A run of the model's text and what it is: :data:`CONTENT`, :data:`REASONING` or :data:`MARKUP`."""

    kind: str
    text: str


class Piece(Protocol):
    """Anything a scanner settles: it covers ``text``, verbatim."""

    @property
    def text(self) -> str: ...


class Scan(Protocol):
    """What one scanner call settled: ``pieces`` cover a prefix of its text, in order; ``state`` is
    the parser's own name for where the text stands after them."""

    @property
    def pieces(self) -> Sequence[Piece]: ...

    @property
    def state(self) -> str: ...


class ScanError(ValueError):
    """A scanner broke its contract (its pieces are not a prefix of the text, or it settles nothing of
    a final text); the message names the parser."""


def parser_label(kind: str, parser: object) -> str:
    """How errors name a parser: ``tool parser 'hermes' (module:Class)``."""
    cls = type(parser)
    return f"{kind} {getattr(cls, 'name', '?')!r} ({cls.__module__}:{cls.__qualname__})"


def drain(scan: Callable[..., Scan], text: str, state: str, *, final: bool,
          who: str) -> tuple[list[Piece], str, str]:
    """Call ``scan(text, state, final=final)`` until nothing more settles; return the pieces, the
    text left unsettled (``""`` when ``final``) and the state. ``who`` names the parser in errors."""
    pieces: list[Piece] = []
    idle = 0
    while text:
        result = scan(text, state, final=final)
        settled = "".join(piece.text for piece in result.pieces)
        if not text.startswith(settled):
            raise ScanError(f"{who}: its pieces {settled[:60]!r} are not the start of the text {text[:60]!r}")
        if not settled:
            if result.state == state:
                if final:
                    raise ScanError(f"{who}: settled nothing of the final text {text[:60]!r} in state {state!r}")
                break
            idle += 1
            if idle > MAX_IDLE_SCANS:
                raise ScanError(f"{who}: changes state without settling text (in state {result.state!r})")
        else:
            idle = 0
        pieces.extend(result.pieces)
        text, state = text[len(settled):], result.state
    return pieces, text, state


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (``"</th"`` of ``"</think>"``:
    4); 0 when none could. A scanner keeps them unsettled until the next delta says."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def unsettled_tail(text: str, markers: Sequence[str]) -> int:
    """Where the characters that could begin one of ``markers`` start at the end of ``text`` (its
    length when none could)."""
    return len(text) - max((partial_marker(text, marker) for marker in markers), default=0)


def begins_with(text: str, marker: str, *, final: bool) -> bool | None:
    """Whether ``text`` begins with ``marker``; None while it may still (it is a start of the marker
    and more text may come)."""
    if text.startswith(marker):
        return True
    return None if marker.startswith(text) and not final else False


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at ``text[start]`` (brackets inside
    strings skipped), or None while it is still open. Says nothing of whether the JSON is valid."""
    closing = {"{": "}", "[": "]"}
    expected: list[str] = []
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in closing:
            expected.append(closing[char])
        elif char in "}]":
            if not expected or expected.pop() != char:
                return index + 1   # a mismatched bracket ends it: invalid JSON, known so far
            if not expected:
                return index + 1
    return None


def leading_space(text: str) -> Span | None:
    """The whitespace ``text`` starts with, as markup (None when it starts with none)."""
    stripped = text.lstrip()
    return Span(MARKUP, text[:len(text) - len(stripped)]) if len(stripped) < len(text) else None


def run_until(text: str, marker: str, kind: str, *, final: bool) -> tuple[tuple[Span, ...], bool]:
    """Settle a run of ``kind`` text that ``marker`` closes.

    When the marker is there: the run before it, then the whitespace before the marker and the
    marker itself as markup, and True. Otherwise False, with what no later text can change: the run
    without the end that could begin the marker or turn out to be whitespace before it (with
    ``final``, all of it).
    """
    index = text.find(marker)
    if index >= 0:
        body = text[:index].rstrip()
        return _spans((kind, body), (MARKUP, text[len(body):index + len(marker)])), True
    body = text if final else text[:unsettled_tail(text, (marker,))].rstrip()
    return _spans((kind, body)), False


def _spans(*parts: tuple[str, str]) -> tuple[Span, ...]:
    return tuple(Span(kind, text) for kind, text in parts if text)
