"""Conformance kit for reasoning-parser plugins: whole and streamed splits agree, nothing is lost.

Use it from a plugin's own pytest::

    from fd_core.testing.conformance import check_reasoning_parser

    def test_my_reasoning_parser_conforms():
        check_reasoning_parser(MyReasoningParser)

It drives the parser over its own
:meth:`~fd_core.contracts.reasoning_parser.ReasoningParser.conformance_samples` (prompt and reply
pairs), every prefix of each reply (a reply cut short, a tag split across deltas) and garbled
replies made from them. See :data:`REASONING_PARSER_CHECKS` for the invariants.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from fd_core.contracts.reasoning_parser import ReasoningText
from fd_core.testing.conformance._factories import plugin_settings
from fd_core.testing.conformance._report import Check, SeamReport, broken, run_checks
from fd_core.testing.conformance._text_parsers import (
    ParserUnderTest,
    check_garbled,
    check_partition,
    check_streaming,
)

if TYPE_CHECKING:
    from fd_core.contracts.reasoning_parser import ReasoningParser

__all__ = ["REASONING_PARSER_CHECKS", "check_reasoning_parser", "run_reasoning_parser_checks"]

SEAM: Final = "reasoning_parser"

SAMPLES: Final = "the samples show reasoning and plain answers"
COVERS: Final = "the pieces are the reply, verbatim; markup is whitespace and markers"
STREAMS: Final = "streaming in any split gives the whole parse"
GARBLED: Final = "any text parses, whole and streamed"
ANSWERS: Final = "a constrained answer is the content, after the reasoning tags"
#: The answer the kit puts where a constraint would (no whitespace next to the tags).
CONSTRAINED_ANSWER: Final = '{"answer": ["yes", 42]}'
#: Reasoning the kit writes where no sample reasons before the end tag.
SOME_REASONING: Final = "Let me think."


def check_reasoning_parser(cls: type[ReasoningParser], *, options: Mapping[str, Any] | None = None,
                           skip: Collection[str] = ()) -> SeamReport:
    """Run every reasoning-parser check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_reasoning_parser_checks(cls, options=options, skip=skip).raise_for_failures()


def run_reasoning_parser_checks(cls: type[ReasoningParser], *, options: Mapping[str, Any] | None = None,
                                skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_reasoning_parser`, but never raises for a broken invariant: every check gets a row."""
    parser = cls(plugin_settings(cls, options))
    subject = ParserUnderTest(
        SEAM, parser, tuple(cls.conformance_samples()),
        initial_state=parser.initial_state,
        whole=lambda prompt, reply: parser.parse(reply, prompt=prompt),
        stream=lambda prompt: parser.stream(prompt=prompt),
        streamed=lambda deltas: ReasoningText("".join(d.reasoning for d in deltas),
                                              "".join(d.content for d in deltas)))
    return run_checks(SEAM, cls.__name__, REASONING_PARSER_CHECKS, skip=skip, args=(subject,))


def _samples(subject: ParserUnderTest) -> None:
    if not subject.cases:
        raise broken(SEAM, SAMPLES, f"{type(subject.parser).__name__}.conformance_samples() gives none")
    parses = [subject.whole(prompt, reply) for prompt, reply in subject.cases]
    if not any(parsed.reasoning and parsed.content for parsed in parses):
        raise broken(SEAM, SAMPLES, "no sample reply has both reasoning and an answer")
    if not any(parsed.content and not parsed.reasoning for parsed in parses):
        raise broken(SEAM, SAMPLES, "no sample reply is a plain answer (no reasoning)")


def _answers(subject: ParserUnderTest) -> None:
    """For each sample prompt, the replies a constraint on the answer gives (``reply_reasoning``) parse
    into that answer: after the reasoning's end tag, or whole where the reply does not reason."""
    parser = subject.parser
    for prompt, reply in subject.cases:
        shape = parser.reply_reasoning(prompt)
        replies = [CONSTRAINED_ANSWER]   # a reply constrained from its first token
        if shape is not None:
            for name, tag in (("end", shape.end), ("start", shape.start)):
                if tag is not None and tag not in _markers(subject):
                    raise broken(SEAM, ANSWERS, f"reply_reasoning({prompt!r}).{name} {tag!r} is not among the "
                                                f"parser's markers {_markers(subject)}")
            opened = shape.start or ""
            reasoned = (reply[:reply.index(shape.end)] if shape.end in reply and reply.startswith(opened)
                        else opened + SOME_REASONING)
            replies = [reasoned + shape.end + CONSTRAINED_ANSWER] + ([CONSTRAINED_ANSWER] if shape.start else [])
        for text in replies:
            whole = subject.whole(prompt, text)
            stream = subject.stream(prompt)
            streamed = subject.streamed([*(stream.feed(char) for char in text), stream.finish()])
            if whole.content != CONSTRAINED_ANSWER or streamed.content != CONSTRAINED_ANSWER:
                raise broken(SEAM, ANSWERS, f"with the prompt {prompt!r}, reply_reasoning gives {shape!r}; the "
                                            f"reply {text!r} parses into the content {whole.content!r} (streamed "
                                            f"{streamed.content!r}), not the constrained answer "
                                            f"{CONSTRAINED_ANSWER!r}")


def _markers(subject: ParserUnderTest) -> tuple[str, ...]:
    return tuple(type(subject.parser).markers)


REASONING_PARSER_CHECKS: Final = (
    Check("samples", SAMPLES, _samples),
    Check("covers_reply", COVERS, lambda s: check_partition(s, partial(broken, SEAM, COVERS), _markers(s))),
    Check("streaming", STREAMS, lambda s: check_streaming(s, partial(broken, SEAM, STREAMS))),
    Check("garbled", GARBLED, lambda s: check_garbled(s, partial(broken, SEAM, GARBLED), _markers(s))),
    Check("constrained_answer", ANSWERS, _answers),
)
