"""``<think>...</think>`` reasoning, as DeepSeek-R1, Qwen3 and QwQ write it.

Three ways a reply starts: with ``<think>`` (the reasoning, up to ``</think>``, then the answer);
inside the reasoning, because the chat template opened ``<think>`` at the end of the prompt (only
``</think>`` appears; Qwen3 thinking, DeepSeek-R1's later templates); or with neither, all answer
(Qwen3 with ``enable_thinking=False``, whose template closes the block in the prompt). A reasoning
block never closed (the reply cut short) is all reasoning. Whitespace next to the tags is markup.

States: ``start``, ``reasoning`` (its first characters: whitespace is markup), ``in_reasoning``,
``answer_start`` (whitespace is markup), ``answer`` (verbatim to the end).
"""

from __future__ import annotations

from typing import ClassVar, Final

from fd_core.contracts.reasoning_parser import ReasoningParser, ReasoningScan, ReplyReasoning
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.text_scan import CONTENT, MARKUP, REASONING, Span, begins_with, leading_space, run_until

OPEN: Final = "<think>"
CLOSE: Final = "</think>"
START, REASONING_START, IN_REASONING, ANSWER_START, ANSWER = (
    "start", "reasoning", "in_reasoning", "answer_start", "answer")


def opened_in(prompt: str, open_tag: str, close_tag: str) -> bool:
    """Whether ``prompt`` ends inside a block ``open_tag`` opened (its last one is not closed)."""
    return prompt.rfind(open_tag) > prompt.rfind(close_tag)


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>``, the opening tag possibly in the prompt."""

    name: ClassVar[str] = "think"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    markers = (OPEN, CLOSE)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Templates of thinking models (they write or strip ``<think>`` blocks)."""
        return OPEN in template or CLOSE in template

    @classmethod
    def conformance_samples(cls) -> tuple[tuple[str, str], ...]:
        """Replies opening ``<think>``, replies to prompts that opened it, plain and cut-short replies."""
        qwen3 = "<|im_start|>assistant\n<think>\n"
        return (
            ("", "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**."),
            (qwen3, "Okay, 北京 is the capital.\n</think>\n\n北京是首都。"),
            ("", "No reasoning here, just the answer: 42."),
            (qwen3, "Still thinking about </thin and more"),
            ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Direct answer, thinking disabled."),
            ("", "<think></think>Empty reasoning."),
        )

    def initial_state(self, prompt: str) -> str:
        """``reasoning`` when the prompt ends inside an opened ``<think>`` block, else ``start``."""
        return REASONING_START if opened_in(prompt, OPEN, CLOSE) else START

    def reply_reasoning(self, prompt: str) -> ReplyReasoning | None:
        """Inside the reasoning up to ``</think>`` when the prompt opened ``<think>``; no reasoning when the
        prompt ends by closing it (Qwen3 with ``enable_thinking=False``); else reasoning only if the reply
        begins with ``<think>``."""
        if opened_in(prompt, OPEN, CLOSE):
            return ReplyReasoning(CLOSE)
        if prompt.rstrip().endswith(CLOSE):
            return None
        return ReplyReasoning(CLOSE, start=OPEN)

    def scan(self, text: str, state: str, *, final: bool) -> ReasoningScan:
        """See :meth:`ReasoningParser.scan`; the states are the module docstring's."""
        if state == ANSWER:
            return ReasoningScan((Span(CONTENT, text),), ANSWER)
        if state == IN_REASONING:
            pieces, closed = run_until(text, CLOSE, REASONING, final=final)
            return ReasoningScan(pieces, ANSWER_START if closed else IN_REASONING)
        space = leading_space(text)
        if space is not None:
            return ReasoningScan((space,), state)
        if state == START:
            opens = begins_with(text, OPEN, final=final)
            if opens is None:
                return ReasoningScan((), START)   # the tag may be arriving
            return ReasoningScan((Span(MARKUP, OPEN),), REASONING_START) if opens else ReasoningScan((), ANSWER)
        return ReasoningScan((), IN_REASONING if state == REASONING_START else ANSWER)
