"""The hermes parser on Hermes / Qwen2.5 / Qwen3 replies: calls between <tool_call> tags."""

from __future__ import annotations

import json

from fd_core.contracts.tool_parser import ToolCall
from fd_plugins.tool_parsers.hermes import HermesToolParser
from tests.fd_plugins.tool_parsers.streaming import counter_ids, streamed

PARSER = HermesToolParser()
QWEN_PARALLEL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "°C"}}\n</tool_call>')


def test_parallel_calls_in_qwen_layout_become_calls_in_order_with_no_content():
    parsed = PARSER.parse(QWEN_PARALLEL, new_id=counter_ids())
    assert parsed.content == ""
    assert parsed.tool_calls == (
        ToolCall("call_0", "get_weather", '{"city": "Paris"}'),
        ToolCall("call_1", "get_weather", '{"city": "東京", "unit": "°C"}'),
    )


def test_text_before_and_after_the_calls_is_content():
    reply = f"I'll look both up.\n\n{QWEN_PARALLEL}\n\nOne moment."
    parsed = PARSER.parse(reply)
    assert parsed.content == "I'll look both up.\n\nOne moment."
    assert [call.name for call in parsed.tool_calls] == ["get_weather", "get_weather"]


def test_ids_are_call_and_24_hex_digits_and_differ():
    ids = [call.id for call in PARSER.parse(QWEN_PARALLEL).tool_calls]
    assert len(set(ids)) == 2
    assert all(i.startswith("call_") and len(i) == 29 and int(i[5:], 16) >= 0 for i in ids)


def test_malformed_json_is_returned_as_text_and_later_calls_still_parse():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parsed = PARSER.parse(f"{bad}\n{good}")
    assert parsed.content == f"{bad}\n"   # the unbalanced object ends at its first closing tag
    assert [call.name for call in parsed.tool_calls] == ["get_time"]
    parsed = PARSER.parse(f'<tool_call>{{"name": 3}}</tool_call>\n{good}')
    assert parsed.content == '<tool_call>{"name": 3}</tool_call>\n'
    assert [call.name for call in parsed.tool_calls] == ["get_time"]


def test_a_reply_cut_off_inside_a_call_is_text():
    reply = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert PARSER.parse(reply).content == reply
    assert PARSER.parse(reply).tool_calls == ()


def test_a_closing_tag_inside_a_json_string_does_not_end_the_call():
    parsed = PARSER.parse('<tool_call>{"name": "echo", "arguments": {"text": "</tool_call> <tool_call>"}}</tool_call>')
    assert parsed.content == ""
    assert json.loads(parsed.tool_calls[0].arguments) == {"text": "</tool_call> <tool_call>"}


def test_arguments_written_as_a_json_string_and_missing_arguments_are_read():
    parsed = PARSER.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                          '<tool_call>{"name": "g"}</tool_call>')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": 1}'), ("g", "{}")]


def test_streaming_holds_a_split_tag_and_passes_each_call_on_once_complete():
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call> ok'
    deltas = ["Checking.<tool", "_call>\n{\"name\": \"get_weather\", ", '"arguments": {"city": "Zürich"}}\n</tool_',
              "call>", " ok"]
    assert "".join(deltas) == reply
    contents, calls = streamed(PARSER, deltas)
    assert contents == ["Checking.", "", "", "", "ok", ""]
    assert [(c.index, c.call) for c in calls] == [(0, ToolCall("call_0", "get_weather", '{"city": "Zürich"}'))]
    assert calls[0].to_openai() == {"index": 0, "id": "call_0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}


def test_a_partial_tag_that_turns_out_to_be_text_is_released():
    contents, calls = streamed(PARSER, ["a <tool", "box> b"])
    assert contents == ["a ", "<toolbox> b", ""] and calls == []


def test_the_template_choice():
    assert HermesToolParser.matches_template("... within <tool_call></tool_call> XML tags ...")
    assert not HermesToolParser.matches_template("{{ messages }}")
