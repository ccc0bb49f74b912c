"""The xgrammar backend passes the guided-decoding kit third-party backends run, and tells a client what is
wrong with a constraint in one clean line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fd_core.contracts.guided_decoding import ConstraintError, mask_words
from fd_core.request import GuidedDecoding
from fd_core.testing.conformance import check_guided_decoding, kit_vocabulary
from fd_core.testing.conformance._guided_samples import END, LOGITS_WIDTH
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


def test_a_length_bounded_string_never_holds_a_raw_control_character():
    """xgrammar 0.2.8 alone lets a tab into a string with minLength/maxLength, which JSON forbids."""
    kit = kit_vocabulary()
    backend = XGrammarBackend(None, vocabulary=kit.vocabulary)
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 3}},
              "required": ["name"]}
    matcher = backend.matcher(backend.compile(GuidedDecoding("json", json.dumps(schema))), (END,))
    by_bytes = {spelled: token for token, spelled in enumerate(kit.token_bytes) if spelled}
    for byte in b'{"name": "':
        assert matcher.accept(by_bytes[bytes([byte])])
    bitmask = np.zeros((1, mask_words(LOGITS_WIDTH)), np.int32)
    allowed = []
    for text in (b"", b"abc"):
        for byte in text:
            assert matcher.accept(by_bytes[bytes([byte])])
        matcher.fill_mask(bitmask, 0)
        allowed.append({spelled for spelled, token in by_bytes.items() if bitmask[0, token // 32] >> (token % 32) & 1})
    assert b"a" in allowed[0] and b'"' not in allowed[0]   # at least one character
    assert not [spelled for spelled in allowed[0] if min(spelled) < 0x20]
    assert all(spelled.startswith(b'"') for spelled in allowed[1])   # three characters: the string ends


def test_large_length_bounds_still_compile():
    """Bounds past MAX_PATTERN_LENGTH_BOUND keep xgrammar's own rule (its pattern automaton fails from ~200)."""
    backend = XGrammarBackend(None, vocabulary=kit_vocabulary().vocabulary)
    for key in ("minLength", "maxLength"):
        schema = {"type": "object", "properties": {"text": {"type": "string", key: 300}}, "required": ["text"]}
        assert backend.compile(GuidedDecoding("json", json.dumps(schema))) is not None
