"""The think parser on DeepSeek-R1 / Qwen3 replies: <think>...</think>, opened by the reply or by the prompt."""

from __future__ import annotations

from fd_core.contracts.reasoning_parser import ReasoningText, ReplyReasoning
from fd_plugins.reasoning_parsers.think import ThinkReasoningParser
from tests.fd_plugins.reasoning_parsers.streaming import joined, streamed

PARSER = ThinkReasoningParser()
QWEN3_THINKING_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_NO_THINKING_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_reply_that_opens_and_closes_the_block():
    reply = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! 你好!"
    assert PARSER.parse(reply) == ReasoningText("The user greets me.\nI greet back.", "Hello! 你好!")


def test_a_prompt_that_opened_the_block_means_the_reply_starts_inside_it():
    reply = "The user greets me.\n</think>\n\nHello!"
    assert PARSER.parse(reply, prompt=QWEN3_THINKING_PROMPT) == ReasoningText("The user greets me.", "Hello!")
    # without that prompt the same text has no reasoning: the tag stays in the answer, nothing is lost
    assert PARSER.parse(reply) == ReasoningText("", reply)


def test_no_think_tag_at_all_is_all_answer_and_thinking_disabled_too():
    assert PARSER.parse("Just the answer.") == ReasoningText("", "Just the answer.")
    assert PARSER.parse("Just the answer.", prompt=QWEN3_NO_THINKING_PROMPT) == ReasoningText("", "Just the answer.")


def test_a_reply_cut_off_while_reasoning_is_all_reasoning():
    assert PARSER.parse("<think>\nStill going </thi") == ReasoningText("Still going </thi", "")
    assert PARSER.parse("Still going", prompt=QWEN3_THINKING_PROMPT) == ReasoningText("Still going", "")


def test_a_closing_tag_split_across_deltas():
    results = streamed(PARSER, ["Okay, 2+2", "=4.\n</th", "ink>", "\n\nIt is ", "4."], prompt=QWEN3_THINKING_PROMPT)
    assert [(r.reasoning, r.content) for r in results] == [
        ("Okay, 2+2", ""), ("=4.", ""), ("", ""), ("", "It is "), ("", "4."), ("", "")]


def test_an_opening_tag_split_across_deltas_and_a_false_alarm():
    assert joined(streamed(PARSER, ["<th", "ink>Hmm.</think>Yes."])) == ReasoningText("Hmm.", "Yes.")
    results = streamed(PARSER, ["<th", "ought>"])
    assert results[0] == ReasoningText() and joined(results) == ReasoningText("", "<thought>")


def test_the_template_choice():
    assert ThinkReasoningParser.matches_template("{%- if '</think>' in content %}")
    assert not ThinkReasoningParser.matches_template("{{ messages }}")


def test_where_a_constrained_answer_starts_follows_the_prompt():
    # the prompt opened the block: the reply reasons up to </think>; it closed it: no reasoning at all;
    # neither (Qwen3 writes <think> itself when thinking): the reply reasons only if it begins with <think>
    assert PARSER.reply_reasoning(QWEN3_THINKING_PROMPT) == ReplyReasoning("</think>")
    assert PARSER.reply_reasoning(QWEN3_NO_THINKING_PROMPT) is None
    assert PARSER.reply_reasoning("<|im_start|>assistant\n") == ReplyReasoning("</think>", start="<think>")
    # an earlier turn's closed block does not close this reply's
    earlier = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n"
    assert PARSER.reply_reasoning(earlier + "<|im_start|>assistant\n") == ReplyReasoning("</think>", start="<think>")
