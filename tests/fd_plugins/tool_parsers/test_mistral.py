"""The mistral parser on Mistral replies: [TOOL_CALLS] with a JSON list (v3-v7) or name[ARGS]{...} (v11+)."""

from __future__ import annotations

import re

from fd_core.contracts.tool_parser import ToolCall
from fd_plugins.tool_parsers.mistral import MistralToolParser
from tests.fd_plugins.tool_parsers.streaming import counter_ids, streamed

PARSER = MistralToolParser()


def test_a_list_of_parallel_calls_keeps_the_ids_the_model_wrote():
    reply = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
             '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]')
    parsed = PARSER.parse(reply, new_id=counter_ids())
    assert parsed.content == ""
    assert parsed.tool_calls == (ToolCall("a1B2c3D4e", "get_weather", '{"city": "Paris"}'),
                                 ToolCall("call_0", "get_time", '{"tz": "Europe/Paris"}'))


def test_the_v11_form_one_tag_per_call():
    parsed = PARSER.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Lyon"}'),
                                                                  ("get_time", "{}")]


def test_text_before_the_calls_is_content_and_made_ids_are_nine_letters_or_digits():
    parsed = PARSER.parse('Je vérifie la météo.[TOOL_CALLS][{"name": "météo", "arguments": {"ville": "Nîmes"}}]')
    assert parsed.content == "Je vérifie la météo."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("météo", '{"ville": "Nîmes"}')]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsed.tool_calls[0].id)


def test_a_list_with_an_item_that_is_not_a_call_is_text_and_so_is_an_unclosed_list():
    for reply in ('[TOOL_CALLS][{"name": "ok", "arguments": {}}, {"arguments": {"no": "name"}}]',
                  '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ni',
                  "[TOOL_CALLS]get_weather[ARGS]not json"):
        assert (PARSER.parse(reply).content, PARSER.parse(reply).tool_calls) == (reply, ())


def test_streaming_waits_for_the_whole_list_and_holds_a_split_tag():
    deltas = ["Ok", "[TOOL_", "CALLS][", '{"name": "a", "arguments": {}}, ',
              '{"name": "b", "arguments": {"x": [1, 2]}}', "]"]
    contents, calls = streamed(PARSER, deltas)
    assert contents == ["Ok", "", "", "", "", "", ""]
    assert [(c.index, c.call.name, c.call.arguments) for c in calls] == [(0, "a", "{}"), (1, "b", '{"x": [1, 2]}')]


def test_the_template_choice():
    assert MistralToolParser.matches_template("[AVAILABLE_TOOLS]...[TOOL_CALLS]")
    assert not MistralToolParser.matches_template("<tool_call>")
