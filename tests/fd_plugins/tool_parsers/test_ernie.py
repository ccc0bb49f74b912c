"""The ernie parser on ERNIE 4.5 thinking-model replies (after the reasoning parser took the reasoning)."""

from __future__ import annotations

from fd_core.contracts.tool_parser import ToolCall
from fd_plugins.tool_parsers.ernie import ErnieToolParser
from fd_plugins.tool_parsers.hermes import HermesToolParser
from tests.fd_plugins.tool_parsers.streaming import counter_ids, streamed

PARSER = ErnieToolParser()
# What ERNIE-4.5-21B-A3B-Thinking writes after "</think>": blank lines, then calls with newlines inside the tags.
ERNIE_CALLS = ('\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "北京", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>\n')


def test_parallel_calls_with_newlines_and_a_call_without_arguments():
    parsed = PARSER.parse(ERNIE_CALLS, new_id=counter_ids())
    assert parsed.content == ""
    assert parsed.tool_calls == (ToolCall("call_0", "get_weather", '{"location": "北京", "unit": "c"}'),
                                 ToolCall("call_1", "get_time", "{}"))


def test_a_call_after_answer_text_is_text():
    reply = 'Use this format: <tool_call>{"name": "x", "arguments": {}}</tool_call>'
    assert PARSER.parse(reply).content == reply
    assert PARSER.parse(reply).tool_calls == ()
    assert HermesToolParser().parse(reply).tool_calls != ()   # where hermes differs


def test_malformed_and_unfinished_calls_are_text():
    for reply in ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "上海"\n</tool_call>',
                  '<tool_call>\n{"name": "get_weather", "arguments": {"location": "广州"}}'):
        parsed = PARSER.parse(reply)
        assert (parsed.content, parsed.tool_calls) == (reply, ())


def test_streaming_token_by_token_with_the_tags_split():
    deltas = ["\n", "\n<tool", "_call>\n{\"name\": \"get_weather\", \"arguments\": ",
              '{"location": "北京", "unit": "c"}}\n</tool_call', ">\n<tool_call>\n{\"name\": \"get_time\"}\n",
              "</tool_call>\n"]
    contents, calls = streamed(PARSER, deltas)
    assert "".join(contents) == ""
    assert [(c.index, c.call.name) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert PARSER.parse("".join(deltas)).content == ""


def test_the_template_choice_prefers_ernie_over_hermes_for_ernie_templates():
    ernie = "<|begin_of_sentence|>{% if tools %}<tool_call>{% endif %}"
    assert ErnieToolParser.matches_template(ernie) and HermesToolParser.matches_template(ernie)
    assert ErnieToolParser.template_priority > HermesToolParser.template_priority
    assert not ErnieToolParser.matches_template("<|im_start|><tool_call>")
