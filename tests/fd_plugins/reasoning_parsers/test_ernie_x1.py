"""The ernie_x1 parser on ERNIE X1 replies: reasoning up to </think>, then <response>...</response> or tool calls."""

from __future__ import annotations

from fd_core.contracts.reasoning_parser import ReasoningText, ReplyReasoning
from fd_plugins.reasoning_parsers.ernie_x1 import ErnieX1ReasoningParser
from fd_plugins.reasoning_parsers.think import ThinkReasoningParser
from fd_plugins.tool_parsers.ernie import ErnieToolParser
from tests.fd_plugins.reasoning_parsers.streaming import joined, streamed

PARSER = ErnieX1ReasoningParser()


def test_reasoning_then_a_response():
    reply = "用户问天气。\n我查一下。\n</think>\n\n<response>\n北京今天晴,\n25°C。\n</response>\n"
    assert PARSER.parse(reply) == ReasoningText("用户问天气。\n我查一下。", "北京今天晴,\n25°C。")


def test_reasoning_then_tool_calls_leaves_the_calls_to_the_tool_parser():
    reply = ('Need the weather.\n</think>\n\n\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"location": "北京"}}\n</tool_call>\n')
    split = PARSER.parse(reply)
    assert split.reasoning == "Need the weather."
    calls = ErnieToolParser().parse(split.content)
    assert (calls.content, [c.name for c in calls.tool_calls]) == ("", ["get_weather"])


def test_a_reply_that_never_closes_its_reasoning_is_all_reasoning_and_an_unclosed_response_is_the_answer():
    assert PARSER.parse("Thinking, cut short </thi") == ReasoningText("Thinking, cut short </thi", "")
    assert PARSER.parse("Done.\n</think>\n<response>The answer") == ReasoningText("Done.", "The answer")


def test_tags_split_across_deltas():
    deltas = ["思考", "中\n</", "think>\n\n<resp", "onse>\n答", "案\n</resp", "onse>\n"]
    results = streamed(PARSER, deltas)
    assert joined(results) == ReasoningText("思考中", "答案")
    assert [r.content for r in results] == ["", "", "", "答", "案", "", ""]


def test_the_template_choice_prefers_ernie_x1_over_think_for_ernie_templates():
    ernie = "<|begin_of_sentence|>{% if '</think>' in content %}"
    assert ErnieX1ReasoningParser.matches_template(ernie) and ThinkReasoningParser.matches_template(ernie)
    assert ErnieX1ReasoningParser.template_priority > ThinkReasoningParser.template_priority
    assert not ErnieX1ReasoningParser.matches_template("<|im_start|></think>")


def test_a_constrained_answer_starts_after_the_reasoning_and_parses_as_the_content():
    assert PARSER.reply_reasoning("<|begin_of_sentence|>User: Hi\nAssistant: ") == ReplyReasoning("</think>")
    assert PARSER.parse('Weather.\n</think>{"city": "北京"}') == ReasoningText("Weather.", '{"city": "北京"}')
