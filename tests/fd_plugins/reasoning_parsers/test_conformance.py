"""Every built-in reasoning parser passes the conformance kit third-party parsers run."""

from __future__ import annotations

import pytest

from fd_core.testing.conformance import check_reasoning_parser
from fd_plugins.reasoning_parsers.ernie_x1 import ErnieX1ReasoningParser
from fd_plugins.reasoning_parsers.think import ThinkReasoningParser


@pytest.mark.parametrize("cls", [ThinkReasoningParser, ErnieX1ReasoningParser])
def test_a_built_in_passes_every_check(cls):
    report = check_reasoning_parser(cls)
    assert [r.status for r in report.results] == ["passed"] * len(report.results)
