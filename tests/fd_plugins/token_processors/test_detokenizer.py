"""Incremental detokenizer: deltas are stable, hold back split characters, and add up exactly."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd_plugins.token_processors.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

MULTILINGUAL = "Hi 😀 你好，世界。 🚀 日本語 ok 👍 café"


def _stream(tokenizer, ids, *, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok.flush()


def test_emoji_split_over_tokens_is_held_back_until_complete(harness):
    ids = harness.encode("a😀b")
    pieces = [harness.tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in p for p in pieces), "the tiny vocab should split the emoji"
    deltas, tail = _stream(harness.tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "😀" in deltas  # emitted whole, by the token that completes it
    assert "".join(deltas) + tail == "a😀b"
    assert tail == ""


def test_multilingual_text_round_trips(harness):
    ids = harness.encode(MULTILINGUAL)
    deltas, tail = _stream(harness.tokenizer, ids)
    assert "".join(deltas) == MULTILINGUAL and tail == ""
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_incomplete_character_comes_out_at_flush_as_the_full_decode_has_it(harness):
    ids = harness.encode("x😀")[:-1]   # cut inside the emoji
    deltas, tail = _stream(harness.tokenizer, ids)
    assert REPLACEMENT_CHAR not in "".join(deltas)
    assert "".join(deltas) + tail == harness.tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)


def test_special_tokens_follow_the_setting(harness):
    ids = [1, *harness.encode("hi"), 2]   # <|im_start|> hi <|im_end|>
    assert "".join(_stream(harness.tokenizer, ids)[0]) == "hi"
    kept, tail = _stream(harness.tokenizer, ids, skip_special_tokens=False)
    assert "".join(kept) + tail == "<|im_start|>hi<|im_end|>"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 511), max_size=40))
def test_random_tokens_concatenate_to_the_full_decode(harness, ids):
    full = harness.tokenizer.decode(ids)
    deltas, tail = _stream(harness.tokenizer, ids)
    streamed = ""
    for k, delta in enumerate(deltas, 1):
        streamed += delta
        # Stable: what went out is never revised by later tokens, and a replacement character
        # only goes out where the final text has one too.
        assert full.startswith(streamed)
        assert harness.tokenizer.decode(ids[:k]).startswith(streamed)
    assert streamed + tail == full


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from(list("ab 😀🎉你好世界。é\n")), max_size=30))
def test_valid_text_never_streams_a_replacement_char(harness, text):
    ids = harness.encode(text)
    deltas, tail = _stream(harness.tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text and tail == ""
