"""Where a reasoning reply's answer starts, found in its tokens' bytes however the tags are split."""

from __future__ import annotations

import random

import pytest

from fd_core.runner.answer_start import ANSWER, OPENING, REASONING, ReasoningTags, ReplyScan

#: Every single byte, then a few longer tokens (ids from 256 on).
LONGER = [b"<", b"think", b">", b"</", b"</think>", b"<think>", b">{", b"{", b"</think>\n", b"th", b"<think></think>{",
          b"<think>\n", b"k>"]
VOCAB = [bytes([byte]) for byte in range(256)] + LONGER


def ids(*pieces: bytes) -> list[int]:
    return [VOCAB.index(piece) for piece in pieces]


def scan(tags: ReasoningTags, tokens: list[int]) -> list[str]:
    """The phase after each token (until the answer starts)."""
    reply, phases = ReplyScan.begin(tags), []
    for token in tokens:
        if reply.phase == ANSWER:
            break
        reply.read(token)
        phases.append(reply.phase)
    return phases


@pytest.mark.parametrize("tag", ["</think>", "</思考>", "\n\n"])
def test_the_end_tag_is_found_at_the_token_that_completes_it_however_the_text_is_split(tag: str) -> None:
    rng = random.Random(0)
    end = tag.encode()
    for _ in range(200):
        # reasoning with near-misses (a tag cut short, its first byte again), the tag, then an answer
        text = b"".join(rng.choice([b"a", b" ", end[:-1], end[:1], "é".encode()]) for _ in range(rng.randint(0, 6)))
        text += end + b"{}"
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        vocab = list(dict.fromkeys(pieces))
        tags = ReasoningTags(None, tag, vocab)
        phases = scan(tags, [vocab.index(piece) for piece in pieces])
        done = next(i for i in range(len(pieces)) if end in b"".join(pieces[:i + 1]))
        assert phases == [REASONING] * done + [ANSWER], (pieces, phases)


def test_a_token_that_would_end_the_tag_in_its_middle_is_masked_while_reasoning() -> None:
    tags = ReasoningTags(None, "</think>", VOCAB)
    after_tag_minus_one = set(tags.overshooting[len(b"</think")].tolist())
    assert VOCAB.index(b">{") in after_tag_minus_one and VOCAB.index(b">") not in after_tag_minus_one
    at_start = set(tags.overshooting[0].tolist())
    assert VOCAB.index(b"</think>\n") in at_start and VOCAB.index(b"</think>") not in at_start
    reply = ReplyScan.begin(tags)
    for token in ids(b"</", b"think"):
        reply.read(token)
    assert reply.phase == REASONING and set(reply.overshooting().tolist()) == after_tag_minus_one


def test_a_reply_reasons_only_if_it_begins_with_the_start_tag() -> None:
    tags = ReasoningTags("<think>", "</think>", VOCAB)
    opening = [set(table.tolist()) for table in tags.opening]
    assert {VOCAB.index(b) for b in (b"<", b"<think>", b"<think>\n")} <= opening[0]
    assert VOCAB.index(b"{") not in opening[0]
    assert VOCAB.index(b"<think></think>{") not in opening[0]   # it would end the reasoning inside a token
    assert set(ids(b"t", b"th", b"think")) <= opening[1] and VOCAB.index(b"<") not in opening[1]
    assert VOCAB.index(b"k>") in opening[len(b"<thin")]
    # the tag in pieces, reasoning, the end tag: the answer starts after it
    assert scan(tags, ids(b"<", b"th", b"i", b"n", b"k>", b"x", b"</", b"think", b">")) == (
        [OPENING] * 4 + [REASONING] * 4 + [ANSWER])
    # a reply that leaves the tag is an answer from its first token
    assert scan(tags, ids(b"<", b"a")) == [OPENING, ANSWER]
    assert scan(tags, ids(b"{")) == [ANSWER]
    # a token that opens and goes on reasoning
    assert scan(tags, ids(b"<think>\n", b"</think>")) == [REASONING, ANSWER]


def test_ids_past_the_vocabulary_and_empty_tokens_are_no_text() -> None:
    tags = ReasoningTags("<think>", "</think>", [b"", *VOCAB[1:]])
    assert scan(tags, [0, 10_000, *ids(b"<think>")]) == [OPENING, OPENING, REASONING]
