"""Conformance kit for tool-parser plugins: whole and streamed parses agree, nothing is lost or invented.

Use it from a plugin's own pytest::

    from fd_core.testing.conformance import check_tool_parser

    def test_my_tool_parser_conforms():
        check_tool_parser(MyToolParser)

It drives the parser over its own :meth:`~fd_core.contracts.tool_parser.ToolParser.conformance_samples`,
every prefix of each (a reply cut short) and garbled replies made from them. See
:data:`TOOL_PARSER_CHECKS` for the invariants.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from fd_core.contracts.tool_parser import FoundCall, ParsedTools, ToolDelta
from fd_core.testing.conformance._factories import plugin_settings
from fd_core.testing.conformance._report import Check, SeamReport, broken, run_checks
from fd_core.testing.conformance._text_parsers import (
    ParserUnderTest,
    check_garbled,
    check_partition,
    check_streaming,
)

if TYPE_CHECKING:
    from fd_core.contracts.tool_parser import ToolParser

__all__ = ["TOOL_PARSER_CHECKS", "check_tool_parser", "run_tool_parser_checks"]

SEAM: Final = "tool_parser"

SAMPLES: Final = "the samples show calls and plain text"
COVERS: Final = "the pieces are the reply, verbatim; markup is whitespace and markers"
STREAMS: Final = "streaming in any split gives the whole parse"
READ: Final = "calls are read from the reply, never invented"
IDS: Final = "every call gets an id: the model's, else the caller's"
GARBLED: Final = "any text parses, whole and streamed"


def check_tool_parser(cls: type[ToolParser], *, options: Mapping[str, Any] | None = None,
                      skip: Collection[str] = ()) -> SeamReport:
    """Run every tool-parser check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_tool_parser_checks(cls, options=options, skip=skip).raise_for_failures()


def run_tool_parser_checks(cls: type[ToolParser], *, options: Mapping[str, Any] | None = None,
                           skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_tool_parser`, but never raises for a broken invariant: every check gets a row."""
    parser = cls(plugin_settings(cls, options))
    subject = ParserUnderTest(
        SEAM, parser, tuple(("", reply) for reply in cls.conformance_samples()),
        initial_state=lambda prompt: parser.initial_state(),
        whole=lambda prompt, reply: _comparable(parser.parse(reply)),
        stream=lambda prompt: parser.stream(),
        streamed=_streamed)
    return run_checks(SEAM, cls.__name__, TOOL_PARSER_CHECKS, skip=skip, args=(subject,))


def _comparable(parsed: ParsedTools) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Content and (name, arguments) of each call: ids are random, so compared by :func:`_ids`."""
    return parsed.content, tuple((call.name, call.arguments) for call in parsed.tool_calls)


def _streamed(deltas: list[ToolDelta]) -> tuple[str, tuple[tuple[str, str], ...]]:
    calls = [call for delta in deltas for call in delta.tool_calls]
    if [call.index for call in calls] != list(range(len(calls))):
        return "calls out of order: indexes " + str([call.index for call in calls]), ()
    return _comparable(ParsedTools("".join(delta.content for delta in deltas), tuple(c.call for c in calls)))


def _samples(subject: ParserUnderTest) -> None:
    if not subject.cases:
        raise broken(SEAM, SAMPLES, f"{type(subject.parser).__name__}.conformance_samples() gives none")
    parses = [subject.parser.parse(reply) for _, reply in subject.cases]
    if not any(parsed.tool_calls for parsed in parses):
        raise broken(SEAM, SAMPLES, "no sample reply parses into a tool call")
    if not any(parsed.content and not parsed.tool_calls for parsed in parses):
        raise broken(SEAM, SAMPLES, "no sample reply is plain text (content and no call)")


def _read_not_invented(subject: ParserUnderTest) -> None:
    for _, reply in subject.cases:
        for end in range(len(reply) + 1):
            for piece in subject.pieces("", reply[:end]):
                if isinstance(piece, FoundCall):
                    _check_call(piece)


def _check_call(call: FoundCall) -> None:
    def fail(detail: str) -> None:
        raise broken(SEAM, READ, f"call {call.name!r} read from {call.text!r}: {detail}")

    if not call.name or call.name not in call.text:
        fail("its name is not in its text")
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        fail(f"arguments {call.arguments!r} are not JSON")
    if not isinstance(arguments, dict):
        fail(f"arguments {call.arguments!r} are not a JSON object")
    for key in arguments:
        if key not in call.text and json.dumps(key)[1:-1] not in call.text:
            fail(f"argument {key!r} is not in its text")


def _ids(subject: ParserUnderTest) -> None:
    parser = subject.parser
    counter = itertools.count()
    seen: set[str] = set()
    for _, reply in subject.cases:
        written = [piece.id for piece in subject.pieces("", reply) if isinstance(piece, FoundCall)]
        given = parser.parse(reply, new_id=lambda: f"given-{next(counter)}").tool_calls
        for call, own in zip(given, written, strict=True):
            if (call.id != own) if own else not call.id.startswith("given-"):
                raise broken(SEAM, IDS, f"call {call.name!r} of {reply!r} got id {call.id!r}; the model wrote "
                                        f"{own!r}, the caller's factory gives 'given-N'")
        for call in parser.parse(reply).tool_calls:
            if not call.id or call.id in seen:
                raise broken(SEAM, IDS, f"call {call.name!r} of {reply!r} got id {call.id!r}, empty or used before")
            seen.add(call.id)


def _markers(subject: ParserUnderTest) -> tuple[str, ...]:
    return tuple(type(subject.parser).markers)


TOOL_PARSER_CHECKS: Final = (
    Check("samples", SAMPLES, _samples),
    Check("covers_reply", COVERS, lambda s: check_partition(s, partial(broken, SEAM, COVERS), _markers(s))),
    Check("streaming", STREAMS, lambda s: check_streaming(s, partial(broken, SEAM, STREAMS))),
    Check("calls_read", READ, _read_not_invented),
    Check("call_ids", IDS, _ids),
    Check("garbled", GARBLED, lambda s: check_garbled(s, partial(broken, SEAM, GARBLED), _markers(s))),
)
