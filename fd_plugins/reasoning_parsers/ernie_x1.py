"""ERNIE X1 reasoning (ERNIE-4.5-21B-A3B-Thinking and its kin).

The chat template opens the reasoning, so a reply starts inside it and closes it with
``</think>`` (newlines around it). Then comes either the answer between ``<response>`` and
``</response>`` or tool calls (``<tool_call>``, left in the content for the ``ernie`` tool parser).
A reply that never closes its reasoning is all reasoning. Whitespace next to the tags is markup.

States: ``reasoning`` (its first characters: whitespace and a stray ``<think>`` are markup),
``in_reasoning``, ``after_reasoning`` (whitespace is markup; ``<response>`` may come),
``response`` (its first characters), ``in_response``, ``answer`` (verbatim to the end).
"""

from __future__ import annotations

from typing import ClassVar, Final

from fd_core.contracts.reasoning_parser import ReasoningParser, ReasoningScan, ReplyReasoning
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.text_scan import CONTENT, MARKUP, REASONING, Span, begins_with, leading_space, run_until
from fd_plugins.reasoning_parsers.think import CLOSE, OPEN

RESPONSE_OPEN: Final = "<response>"
RESPONSE_CLOSE: Final = "</response>"
REASONING_START, IN_REASONING, AFTER_REASONING, RESPONSE_START, IN_RESPONSE, ANSWER = (
    "reasoning", "in_reasoning", "after_reasoning", "response", "in_response", "answer")
#: Strings only ERNIE's chat templates hold.
ERNIE_TEMPLATE_MARKS: Final = ("<|begin_of_sentence|>", "<|end_of_sentence|>", RESPONSE_OPEN)


class ErnieX1ReasoningParser(ReasoningParser):
    """ERNIE X1: reasoning up to ``</think>``, then ``<response>...</response>`` or tool calls."""

    name: ClassVar[str] = "ernie_x1"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    markers = (OPEN, CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
    template_priority = 1   # its templates also hold the tag the think parser looks for

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """ERNIE templates of thinking models."""
        return CLOSE in template and any(mark in template for mark in ERNIE_TEMPLATE_MARKS)

    @classmethod
    def conformance_samples(cls) -> tuple[tuple[str, str], ...]:
        """An answer, tool calls after the reasoning, replies cut short, empty reasoning, unicode."""
        return (
            ("", "用户问天气。\n我需要调用工具。\n</think>\n\n<response>\n北京今天晴。\n</response>\n"),
            ("", "Need the weather.\n</think>\n\n\n<tool_call>\n"
                 '{"name": "get_weather", "arguments": {"location": "北京"}}\n</tool_call>\n'),
            ("", "Thinking, cut short before the tag </thi"),
            ("", "Done.\n</think>\n<response>The answer, never closed"),
            ("", "</think>\n\n<response>\nNo reasoning needed.\n</response>"),
        )

    def initial_state(self, prompt: str) -> str:
        """Always inside the reasoning: X1's template opens it."""
        return REASONING_START

    def reply_reasoning(self, prompt: str) -> ReplyReasoning | None:
        """Inside the reasoning up to ``</think>`` (X1's template opens it)."""
        return ReplyReasoning(CLOSE)

    def scan(self, text: str, state: str, *, final: bool) -> ReasoningScan:
        """See :meth:`ReasoningParser.scan`; the states are the module docstring's."""
        if state == ANSWER:
            return ReasoningScan((Span(CONTENT, text),), ANSWER)
        if state == IN_REASONING:
            pieces, closed = run_until(text, CLOSE, REASONING, final=final)
            return ReasoningScan(pieces, AFTER_REASONING if closed else IN_REASONING)
        if state == IN_RESPONSE:
            pieces, closed = run_until(text, RESPONSE_CLOSE, CONTENT, final=final)
            return ReasoningScan(pieces, AFTER_REASONING if closed else IN_RESPONSE)
        space = leading_space(text)
        if space is not None:
            return ReasoningScan((space,), state)
        if state == REASONING_START:   # a stray <think> is markup too
            return _tag_or(text, state, OPEN, REASONING_START, IN_REASONING, final=final)
        if state == AFTER_REASONING:
            return _tag_or(text, state, RESPONSE_OPEN, RESPONSE_START, ANSWER, final=final)
        return ReasoningScan((), IN_RESPONSE)   # the response's leading whitespace is settled


def _tag_or(text: str, state: str, tag: str, after_tag: str, otherwise: str, *, final: bool) -> ReasoningScan:
    """``tag`` as markup, then ``after_tag``, when ``text`` begins with it; else on to ``otherwise``
    (in ``state`` while the tag may be arriving)."""
    opens = begins_with(text, tag, final=final)
    if opens is None:
        return ReasoningScan((), state)
    return ReasoningScan((Span(MARKUP, tag),), after_tag) if opens else ReasoningScan((), otherwise)
