"""What the tool-parser and reasoning-parser kits share: deltas in every split, garbled replies, the
checks that hold for both (the scan covers the reply exactly; streaming equals whole parsing; any
text parses)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from fd_core.text_scan import MARKUP, Piece, Span, drain, parser_label

#: Seeds of the random chunkings and of the garbled replies.
SEEDS: Final = (0, 1, 2)
#: Longest random chunk, in characters.
MAX_CHUNK: Final = 8
#: Garbled replies per seed.
GARBLED: Final = 12


@dataclass(frozen=True, slots=True)
class ParserUnderTest:
    """One parser as the shared checks drive it; ``cases`` are (prompt, reply) pairs."""

    seam: str
    parser: Any
    cases: tuple[tuple[str, str], ...]
    initial_state: Callable[[str], str]     # prompt -> the state a reply starts in
    whole: Callable[[str, str], Any]        # (prompt, reply) -> the parse, comparable
    stream: Callable[[str], Any]            # prompt -> a fresh stream (feed, finish)
    streamed: Callable[[list[Any]], Any]    # a stream's deltas -> what ``whole`` gives

    def pieces(self, prompt: str, reply: str) -> list[Piece]:
        """The pieces a whole parse of ``reply`` settles."""
        who = parser_label(self.seam.replace("_", " "), self.parser)
        pieces, _, _ = drain(self.parser.scan, reply, self.initial_state(prompt), final=True, who=who)
        return pieces


def splits(text: str) -> Iterator[tuple[str, list[str]]]:
    """(how, deltas): the text whole, one character a delta, and random chunks for each seed."""
    yield "in one delta", [text]
    yield "one character a delta", list(text)
    for seed in SEEDS:
        rng = random.Random(seed)
        chunks, index = [], 0
        while index < len(text):
            size = rng.randint(1, MAX_CHUNK)
            chunks.append(text[index:index + size])
            index += size
        yield f"in random chunks (seed {seed})", chunks


def garbled(samples: list[str], markers: tuple[str, ...], seed: int) -> list[str]:
    """Replies made of pieces of the samples, markers, brackets, quotes and unicode in random order."""
    rng = random.Random(seed)
    bits = [*markers, "{", "}", "[", "]", '"', "\\", ",", ":", ";", "\n", " ", "é", "北", "🙂", '{"name": "f"',
            '"arguments": {}', '"parameters": {"a": 1}}']
    for sample in samples:
        for _ in range(4):
            start = rng.randrange(len(sample) + 1)
            bits.append(sample[start:start + rng.randint(1, 30)])
    return ["".join(rng.choice(bits) for _ in range(rng.randint(1, 25))) for _ in range(GARBLED)]


def check_partition(subject: ParserUnderTest, broken: Callable[[str], Exception], markers: tuple[str, ...]) -> None:
    """The pieces of every case, and of every prefix of it, are the text, verbatim; markup is
    whitespace and ``markers`` only."""
    for prompt, reply in subject.cases:
        for end in range(len(reply) + 1):
            _check_pieces(subject, prompt, reply[:end], broken, markers)


def _check_pieces(subject: ParserUnderTest, prompt: str, reply: str, broken: Callable[[str], Exception],
                  markers: tuple[str, ...]) -> None:
    pieces = subject.pieces(prompt, reply)
    covered = "".join(piece.text for piece in pieces)
    if covered != reply:
        raise broken(f"the pieces of {reply!r} cover {covered!r}")
    for piece in pieces:
        if isinstance(piece, Span) and piece.kind == MARKUP and _without(piece.text, markers).strip():
            raise broken(f"markup {piece.text!r} of {reply!r} holds more than whitespace and the markers {markers}")


def _without(text: str, markers: tuple[str, ...]) -> str:
    for marker in sorted(markers, key=len, reverse=True):
        text = text.replace(marker, "")
    return text


def check_streaming(subject: ParserUnderTest, broken: Callable[[str], Exception]) -> None:
    """Streaming every case in every split gives the whole parse; so does every prefix streamed one
    character a delta (a reply cut short)."""
    for prompt, reply in subject.cases:
        for how, deltas in splits(reply):
            stream = subject.stream(prompt)
            got = subject.streamed([*(stream.feed(delta) for delta in deltas), stream.finish()])
            want = subject.whole(prompt, reply)
            if got != want:
                raise broken(f"{reply!r} streamed {how} gives {got!r}, parsed whole {want!r}")
        stream, deltas = subject.stream(prompt), []
        for end in range(len(reply) + 1):
            cut = copy.copy(stream)   # the reply ends here
            got = subject.streamed([*deltas, cut.finish()])
            want = subject.whole(prompt, reply[:end])
            if got != want:
                raise broken(f"{reply[:end]!r} streamed one character a delta gives {got!r}, parsed whole {want!r}")
            if end < len(reply):
                deltas.append(stream.feed(reply[end]))


def check_garbled(subject: ParserUnderTest, broken: Callable[[str], Exception], markers: tuple[str, ...]) -> None:
    """Garbled replies (pieces of the cases, markers, brackets, unicode) parse, whole and streamed,
    with pieces that cover them; the parser raises nothing."""
    samples = [reply for _, reply in subject.cases]
    for seed in SEEDS:
        for reply in garbled(samples, markers, seed):
            _check_pieces(subject, "", reply, broken, markers)
            stream = subject.stream("")
            got = subject.streamed([*(stream.feed(char) for char in reply), stream.finish()])
            want = subject.whole("", reply)
            if got != want:
                raise broken(f"garbled reply {reply!r} (seed {seed}) streamed gives {got!r}, parsed whole {want!r}")
