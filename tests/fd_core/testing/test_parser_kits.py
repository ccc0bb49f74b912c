"""The parser kits catch parsers that break their invariants, naming the invariant and the text."""

from __future__ import annotations

from typing import ClassVar

import pytest

from fd_core.contracts.reasoning_parser import ReasoningParser, ReasoningScan, ReplyReasoning
from fd_core.contracts.tool_parser import FoundCall, ToolScan
from fd_core.testing.conformance import (
    ConformanceError,
    check_reasoning_parser,
    check_tool_parser,
    run_tool_parser_checks,
)
from fd_core.text_scan import CONTENT, MARKUP, Span
from fd_plugins.reasoning_parsers.think import ThinkReasoningParser
from fd_plugins.tool_parsers.hermes import HermesToolParser


class _Hasty(HermesToolParser):
    """Settles answer text at once, never holding back a tag that may be split."""

    name: ClassVar[str] = "hasty"

    def scan(self, text, state, *, final):
        if state == "text" and self.open_tag not in text:
            return ToolScan((Span(CONTENT, text),), "text")
        return super().scan(text, state, final=final)


class _Inventive(HermesToolParser):
    """Turns an unfinished call into a call with empty arguments."""

    name: ClassVar[str] = "inventive"

    def scan(self, text, state, *, final):
        if final and state == "start" and text.startswith(self.open_tag) and self.close_tag not in text:
            return ToolScan((FoundCall("guessed", "{}", text),), "start")
        return super().scan(text, state, final=final)


class _Swallower(ThinkReasoningParser):
    """Hides the answer's first word in markup."""

    name: ClassVar[str] = "swallower"

    def scan(self, text, state, *, final):
        if state == "answer":
            word, _, rest = text.partition(" ")
            if not rest:
                return ReasoningScan((Span(CONTENT, text),), "answer")
            return ReasoningScan((Span(MARKUP, word + " "), Span(CONTENT, rest)), "answer")
        return super().scan(text, state, final=final)


class _Unaware(ThinkReasoningParser):
    """Keeps the contract's default reply_reasoning (constraints from the first token), though its prompts
    open the reasoning: a constrained answer would be read as reasoning."""

    name: ClassVar[str] = "unaware"
    reply_reasoning = ReasoningParser.reply_reasoning


class _Untagged(ThinkReasoningParser):
    """Names an end tag that is not among its markers."""

    name: ClassVar[str] = "untagged"

    def reply_reasoning(self, prompt):
        return ReplyReasoning("</thought>")


@pytest.mark.parametrize(("check", "cls", "words"), [
    (check_tool_parser, _Hasty, "tool parser invariant 'streaming in any split gives the whole parse' broken: "),
    (check_tool_parser, _Inventive, "tool parser invariant 'calls are read from the reply, never invented' broken: "
                                    "call 'guessed' read from '<tool_call>"),
    (check_reasoning_parser, _Swallower, "reasoning parser invariant 'the pieces are the reply, verbatim; markup is "
                                         "whitespace and markers' broken: markup 'The ' of"),
    (check_reasoning_parser, _Unaware, "reasoning parser invariant 'a constrained answer is the content, after the "
                                       "reasoning tags' broken: with the prompt '<|im_start|>assistant\\n<think>\\n', "
                                       "reply_reasoning gives None; the reply '{\"answer\""),
    (check_reasoning_parser, _Untagged, "reasoning parser invariant 'a constrained answer is the content, after the "
                                        "reasoning tags' broken: reply_reasoning('').end '</thought>' is not among"),
])
def test_a_broken_parser_fails_naming_the_invariant(check, cls, words):
    with pytest.raises(ConformanceError) as caught:
        check(cls)
    assert str(caught.value).startswith(words), str(caught.value)


def test_a_parser_without_samples_fails_the_samples_check_only():
    class Silent(HermesToolParser):
        name: ClassVar[str] = "silent"

        @classmethod
        def conformance_samples(cls):
            return ()

    report = run_tool_parser_checks(Silent)
    assert [r.check for r in report.failures] == ["samples"]
    assert report.failures[0].detail == "Silent.conformance_samples() gives none"
