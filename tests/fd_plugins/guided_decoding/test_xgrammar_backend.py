"""The xgrammar backend passes the guided-decoding kit third-party backends run, and tells a client what is
wrong with a constraint in one clean line."""

from __future__ import annotations

import json

import pytest

from fd_core.contracts.guided_decoding import ConstraintError
from fd_core.request import GuidedDecoding
from fd_core.testing.conformance import check_guided_decoding, kit_vocabulary
from fd_plugins.guided_decoding.xgrammar_backend import XGrammarBackend

pytest.importorskip("xgrammar")


@pytest.mark.parametrize("options", [None, {"any_whitespace": True, "cache_mb": 0}])
def test_xgrammar_passes_every_check(options):
    report = check_guided_decoding(XGrammarBackend, options=options)
    assert [r.status for r in report.results] == ["passed"] * len(report.results), report


@pytest.mark.parametrize(("constraint", "message"), [
    (GuidedDecoding("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "unicorn"}})),
     "Invalid structural tag error: Format type not recognized: unicorn"),
    (GuidedDecoding("grammar", 'root ::= "a" b'), 'EBNF parser error at line 1, column 14: Rule "b" is not defined'),
])
def test_errors_lose_xgrammars_source_location_and_failed_check(constraint, message):
    backend = XGrammarBackend(None, vocabulary=kit_vocabulary().vocabulary)
    with pytest.raises(ConstraintError) as caught:
        backend.compile(constraint)
    assert str(caught.value) == message
