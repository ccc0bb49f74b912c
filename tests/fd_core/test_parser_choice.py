"""How the tool and reasoning parsers are chosen: 'auto' by the chat template, 'none', or by name."""

from __future__ import annotations

from typing import ClassVar

import pytest

from fd_core.config import load_config
from fd_core.errors import ConfigError
from fd_core.parser_choice import choose_parser, parser_for_template
from fd_core.registry import Registry
from fd_core.selection import resolve
from fd_plugins.reasoning_parsers.think import ThinkReasoningParser
from fd_plugins.tool_parsers.ernie import ErnieToolParser
from fd_plugins.tool_parsers.hermes import HermesToolParser
from fd_plugins.tool_parsers.mistral import MistralToolParser

QWEN3_TEMPLATE = "{%- if tools %}<tool_call>\n{%- endif %}{%- if '</think>' in content %}<|im_start|>"
ERNIE_TEMPLATE = "<|begin_of_sentence|>{%- if tools %}<tool_call>{%- endif %}</think><response>"


@pytest.fixture(scope="module")
def installed():
    return Registry.discover()


def test_auto_picks_by_template_and_the_more_specific_family_wins(installed):
    assert parser_for_template(installed, "tool_parser", QWEN3_TEMPLATE) is HermesToolParser
    assert parser_for_template(installed, "tool_parser", ERNIE_TEMPLATE) is ErnieToolParser
    assert parser_for_template(installed, "reasoning_parser", QWEN3_TEMPLATE) is ThinkReasoningParser
    assert parser_for_template(installed, "reasoning_parser", ERNIE_TEMPLATE).name == "ernie_x1"
    assert parser_for_template(installed, "tool_parser", "{{ messages }}") is None
    assert parser_for_template(installed, "tool_parser", "") is None


def test_choose_parser_follows_the_config(installed):
    for names, tool, reasoning in ((["--tool_parser.name", "none"], None, ThinkReasoningParser),
                                   (["--tool_parser.name", "mistral", "--reasoning_parser.name", "none"],
                                    MistralToolParser, None),
                                   ([], HermesToolParser, ThinkReasoningParser)):
        config = load_config(cli_args=names)
        resolve(config, installed)   # start-up accepts it
        got = [choose_parser(config, installed, seam, QWEN3_TEMPLATE) for seam in ("tool_parser", "reasoning_parser")]
        assert [type(p) if p is not None else None for p in got] == [tool, reasoning]


def test_a_named_parser_is_loaded_at_start_up_and_bad_names_and_options_are_config_errors(installed):
    assert resolve(load_config(cli_args=["--tool_parser.name", "hermes"]), installed).summary()["tool_parser"] \
        == "hermes"
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(cli_args=["--tool_parser.name", "hermez", "--reasoning_parser.options", '{"x": 1}']),
                installed)
    message = str(caught.value)
    assert "tool_parser.name: plugin fd.tool_parsers/hermez: no such tool parser; available: auto, none, ernie, " \
           "hermes, llama3_json, mistral" in message
    assert "reasoning_parser.options: given, but reasoning_parser.name is 'auto'" in message
    with pytest.raises(ConfigError, match=r"tool_parser.options: plugin 'hermes' takes no options, got \['x'\]"):
        resolve(load_config(cli_args=["--tool_parser.name", "hermes", "--tool_parser.options", '{"x": 1}']), installed)


class _QwenVariant(HermesToolParser):
    name: ClassVar[str] = "qwen-variant"


class _OtherQwenVariant(HermesToolParser):
    name: ClassVar[str] = "other-qwen-variant"


def test_a_third_party_parser_goes_before_the_built_in_and_two_tied_are_an_error():
    one = Registry.from_plugins({"tool_parser": [_QwenVariant]})
    assert parser_for_template(one, "tool_parser", QWEN3_TEMPLATE) is _QwenVariant
    two = Registry.from_plugins({"tool_parser": [_QwenVariant, _OtherQwenVariant]})
    with pytest.raises(ConfigError, match="tool_parser.name: the chat template is claimed by several plugins "
                                          r"\(fd.tool_parsers/other-qwen-variant .*, fd.tool_parsers/qwen-variant"):
        parser_for_template(two, "tool_parser", QWEN3_TEMPLATE)
