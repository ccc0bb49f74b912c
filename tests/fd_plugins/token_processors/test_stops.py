"""Stop-string matcher: matches across delta boundaries and never releases part of a stop string."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fd_plugins.token_processors.stops import StopStringMatcher


def _run(stops, chunks, *, include=False, active=True):
    matcher = StopStringMatcher.build(stops, include_stop_str=include)
    released = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk, active=active)
        released.append(text)
        if matched:
            return released, True
    released.append(matcher.flush())
    return released, False


def _reference(stops, text, include):
    """Cut ``text`` at the stop match that ends first (ties: the longer one)."""
    matches = [(i + len(s), i) for s in stops if s for i in range(len(text)) if text.startswith(s, i)]
    if not matches:
        return text, False
    end, start = min(matches)
    return text[:end if include else start], True


def test_build_drops_empty_stop_strings():
    assert StopStringMatcher.build(["", ""], include_stop_str=False) is None
    assert StopStringMatcher.build(["", "x"], include_stop_str=False).stops == ("x",)


def test_stop_split_over_chunks_is_held_then_cut():
    released, matched = _run(["STOP"], ["abc S", "T", "OP tail"])
    assert matched
    assert released == ["abc ", "", ""]


def test_include_stop_str_releases_it_at_the_match():
    released, matched = _run(["STOP"], ["abc S", "T", "OP tail"], include=True)
    assert matched and released == ["abc ", "", "STOP"]


def test_false_start_is_released_when_resolved():
    released, matched = _run(["STOP"], ["ST", "x"])
    assert not matched and released == ["", "STx", ""]


def test_held_text_is_flushed_when_no_match_comes():
    assert _run(["STOP"], ["a ST"]) == (["a ", "ST"], False)


def test_inactive_matches_are_ignored_but_prefixes_still_held():
    matcher = StopStringMatcher.build(["ab"], include_stop_str=False)
    assert matcher.feed("xab", active=False) == ("xab", False)
    assert matcher.feed("a", active=False) == ("", False)
    # The stop string completes once active: the held "a" is cut too.
    assert matcher.feed("b", active=True) == ("", True)


def test_earliest_ending_match_wins():
    assert _run(["abcd", "bc"], ["abcd"])[0] == ["a"]
    assert _run(["abc", "bc"], ["xabc"], include=True)[0] == ["xabc"]


@given(
    text=st.text(st.sampled_from("abc😀"), max_size=25),
    stops=st.lists(st.text(st.sampled_from("abc😀"), min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 25), max_size=8),
    include=st.booleans(),
)
def test_any_chunking_gives_the_reference_result(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    released, matched = _run(stops, chunks, include=include)
    expected, expected_match = _reference(stops, text, include)
    assert (("".join(released)), matched) == (expected, expected_match)
    if matched:
        # Before the match was seen, nothing released was part of a stop string.
        before = "".join(released[:-1])
        assert len(before) <= len(_reference(stops, text, False)[0])
