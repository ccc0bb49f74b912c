"""The llama3_json parser on Llama 3.1-3.3 replies: JSON objects, ';'-separated, optionally after <|python_tag|>."""

from __future__ import annotations

from fd_core.contracts.tool_parser import ToolCall
from fd_plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from tests.fd_plugins.tool_parsers.streaming import counter_ids, streamed

PARSER = Llama3JsonToolParser()


def test_a_bare_call_and_parallel_calls_after_the_python_tag():
    assert PARSER.parse('{"name": "get_weather", "parameters": {"city": "São Paulo"}}', new_id=counter_ids()) \
        .tool_calls == (ToolCall("call_0", "get_weather", '{"city": "São Paulo"}'),)
    parsed = PARSER.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]


def test_text_before_the_python_tag_is_content_and_arguments_is_read_too():
    parsed = PARSER.parse('Let me search.<|python_tag|>{"name": "search", "arguments": {"q": "a;b"}}')
    assert parsed.content == "Let me search."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", '{"q": "a;b"}')]


def test_json_that_is_not_a_call_and_text_after_calls_stay_content():
    assert PARSER.parse('{"answer": 42}').content == '{"answer": 42}'
    parsed = PARSER.parse('{"name": "f", "parameters": {}} and then some words')
    assert [c.name for c in parsed.tool_calls] == ["f"]
    assert parsed.content == "and then some words"
    assert PARSER.parse("The answer is {x}; fine.").content == "The answer is {x}; fine."


def test_a_reply_cut_off_mid_call_is_text():
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Li'
    assert PARSER.parse(reply).content == '{"name": "get_weather", "parameters": {"city": "Li'
    assert PARSER.parse(reply).tool_calls == ()


def test_streaming_with_the_python_tag_split():
    deltas = ["<|py", "thon_tag|>", '{"name": "a", "param', 'eters": {"x": 1}}', ";", ' {"name": "b", ',
              '"parameters": {}}']
    contents, calls = streamed(PARSER, deltas)
    assert "".join(contents) == ""
    assert [(c.index, c.call.name) for c in calls] == [(0, "a"), (1, "b")]
    stream = PARSER.stream()
    arrived = [[c.call.name for c in stream.feed(delta).tool_calls] for delta in deltas]
    assert arrived == [[], [], [], ["a"], [], [], ["b"]]   # each call as soon as its object closes


def test_the_template_choice():
    assert Llama3JsonToolParser.matches_template("<|start_header_id|>ipython<|end_header_id|><|python_tag|>")
    assert Llama3JsonToolParser.matches_template('<|start_header_id|>{"name": function name, "parameters": ...}')
    assert not Llama3JsonToolParser.matches_template("<|im_start|><tool_call>")
