"""Every built-in tool parser passes the conformance kit third-party parsers run."""

from __future__ import annotations

import pytest

from fd_core.testing.conformance import check_tool_parser
from fd_plugins.tool_parsers.ernie import ErnieToolParser
from fd_plugins.tool_parsers.hermes import HermesToolParser
from fd_plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from fd_plugins.tool_parsers.mistral import MistralToolParser


@pytest.mark.parametrize("cls", [HermesToolParser, ErnieToolParser, Llama3JsonToolParser, MistralToolParser])
def test_a_built_in_passes_every_check(cls):
    report = check_tool_parser(cls)
    assert [r.status for r in report.results] == ["passed"] * len(report.results)
