"""The scanning helpers parsers are built from, and the loop that refuses a scanner breaking its contract."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fd_core.text_scan import (
    CONTENT,
    MARKUP,
    REASONING,
    ScanError,
    Span,
    drain,
    json_value_end,
    partial_marker,
    run_until,
)


def test_partial_marker_counts_the_characters_that_could_begin_it():
    assert partial_marker("abc </th", "</think>") == 4
    assert partial_marker("abc <", "</think>") == 1
    assert partial_marker("abc </think", "</think>") == 7
    assert partial_marker("abc", "</think>") == 0


def test_json_value_end_skips_brackets_in_strings_and_waits_for_the_close():
    text = '{"a": "}]\\"{", "b": [1, {"c": 2}]} tail'
    assert text[:json_value_end(text, 0)] == '{"a": "}]\\"{", "b": [1, {"c": 2}]}'
    assert json_value_end('{"a": [1, 2', 0) is None
    assert json_value_end('{"a": ]', 0) == 7   # a mismatched bracket ends it: invalid, known now


def test_run_until_holds_whitespace_and_a_split_marker_back():
    assert run_until("abc \n</th", "</think>", REASONING, final=False) == ((Span(REASONING, "abc"),), False)
    assert run_until("abc \n</think>x", "</think>", REASONING, final=False) == (
        (Span(REASONING, "abc"), Span(MARKUP, " \n</think>")), True)
    assert run_until("abc \n</th", "</think>", REASONING, final=True) == ((Span(REASONING, "abc \n</th"),), False)


@dataclass(frozen=True)
class _Scan:
    pieces: tuple
    state: str


def test_drain_refuses_pieces_that_are_not_the_text_and_a_final_scan_that_settles_nothing():
    with pytest.raises(ScanError, match=r"^tool parser 'x': its pieces 'xyz' are not the start of the text 'abc'"):
        drain(lambda text, state, final: _Scan((Span(CONTENT, "xyz"),), state), "abc", "s", final=False,
              who="tool parser 'x'")
    with pytest.raises(ScanError, match="settled nothing of the final text 'abc' in state 's'"):
        drain(lambda text, state, final: _Scan((), state), "abc", "s", final=True, who="p")
    with pytest.raises(ScanError, match="changes state without settling text"):
        drain(lambda text, state, final: _Scan((), state + "!"), "abc", "s", final=False, who="p")
    assert drain(lambda text, state, final: _Scan((), state), "abc", "s", final=False, who="p") == ([], "abc", "s")
