"""Conformance kit for guided-decoding backends: constraints compile, masks are exact, matchers stop where they should.

Use it from a backend's own pytest::

    from fd_core.testing.conformance import check_guided_decoding

    def test_my_backend_conforms():
        check_guided_decoding(MyBackend)

The backend is built as the engine builds it, over the kit's vocabulary (:func:`kit_vocabulary`:
a small byte-level BPE with an end-of-sequence token, a second stop token, a special token that is
neither, and padding ids). It compiles one constraint of each kind it declares
(``supported_kinds``), and matchers follow their masks: seeded random walks (at each step a random
allowed token, or an allowed stop id half the time), and a walk along a known valid output. A
backend whose library is missing here (``GuidedDecodingUnavailable``) has every check skipped,
naming why. See :data:`GUIDED_DECODING_CHECKS` for the invariants.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fd_core.contracts.guided_decoding import ConstraintError, GuidedDecodingUnavailable, mask_words
from fd_core.request import GUIDED_KINDS, GuidedDecoding
from fd_core.testing.conformance._factories import ThreadCall, plugin_settings
from fd_core.testing.conformance._guided_samples import (
    END,
    INVALID,
    LOGITS_WIDTH,
    OTHER,
    SAMPLES,
    STOP,
    KitVocabulary,
    Sample,
    completes,
    decoded,
    kit_vocabulary,
    label,
)
from fd_core.testing.conformance._report import Check, SeamReport, Skip, broken, run_checks

if TYPE_CHECKING:
    from fd_core.contracts.guided_decoding import ConstraintMatcher, GuidedDecodingBackend

__all__ = ["GUIDED_DECODING_CHECKS", "check_guided_decoding", "kit_vocabulary", "run_guided_decoding_checks"]

SEAM: Final = "guided_decoding"

KINDS: Final = "declared kinds compile; another kind is refused, naming it"
INVALID_SPECS: Final = "a constraint that does not compile raises ConstraintError with a one-line message"
LAYOUT: Final = "fill_mask writes every bit of its int32 row and no other row; padding ids stay clear"
WALKS: Final = "following the mask ends in a stop token, with an output that satisfies the constraint"
AGREES: Final = "every token the mask allows is accepted; a refused token changes nothing"
EXACT: Final = "the mask allows exactly the tokens that continue an output"
STOPS: Final = "the mask allows the matcher's stop ids, and no other special token, just where the output is complete"
VALID: Final = "a valid output gets through the mask"
CACHED: Final = "an equal constraint compiled again behaves the same; a different one does not"
INDEPENDENT: Final = "matchers of one compiled constraint share no state, also on two threads"
ROLLBACK: Final = "rollback(n) returns a matcher to its state n tokens before (supports_rollback)"

#: Most tokens the rollback check accepts before rolling them back (speculative decoding's runs).
ROLLBACK_RUN: Final = 4
#: Seeds of the random walks; a walk with seed ``s`` ends on the stop ids ``STOP_SETS[s]``.
SEEDS: Final = (0, 1, 2)
#: The stop ids a matcher is made with: the vocabulary's eos alone, the other stop token alone, both.
STOP_SETS: Final = ((END,), (STOP,), (END, STOP))
#: Longest walk, in tokens, where the outputs are short (every one is far shorter); and where they
#: nest without bound (any JSON object), how far a walk goes before it stops looking.
MAX_WALK: Final = 256
MAX_OPEN_WALK: Final = 48
#: At each step of the agreement check: allowed tokens replayed on a fresh matcher, refused tokens tried.
PROBES: Final = 2
REFUSALS: Final = 3
#: Rounds each thread replays its walk in the independence check.
THREAD_ROUNDS: Final = 3
#: How many whitespace-only tokens in a row the valid-output walk takes (a layout's), at most.
MAX_SPACES: Final = 8
#: What the rows around the one a matcher fills hold in the bitmask check.
SENTINEL: Final = 0x5A5A5A5A
_WHITESPACE: Final = b" \t\n\r"
#: A source location in an error message (``grammar_matcher.cc:1687``): nothing a client can act on.
_SOURCE_LOCATION: Final = re.compile(r"[\w./-]+\.(?:py|pyx|c|cc|cpp|cxx|h|hpp|rs|go):\d+")


def check_guided_decoding(cls: type[GuidedDecodingBackend], *, options: Mapping[str, Any] | None = None,
                          skip: Collection[str] = ()) -> SeamReport:
    """Run every guided-decoding check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_guided_decoding_checks(cls, options=options, skip=skip).raise_for_failures()


def run_guided_decoding_checks(cls: type[GuidedDecodingBackend], *, options: Mapping[str, Any] | None = None,
                               skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_guided_decoding`, but never raises for a broken invariant: every check gets a row.
    Bad options raise pydantic's ValidationError (or ValueError)."""
    kit = _Kit(cls, plugin_settings(cls, options), kit_vocabulary())
    return run_checks(SEAM, cls.__name__, GUIDED_DECODING_CHECKS, skip=skip, args=(kit,))


class _Kit:
    """The backend under test (built on first use, as the engine builds it) and its compiled samples."""

    def __init__(self, cls: type[GuidedDecodingBackend], settings: Any, vocab: KitVocabulary) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.settings = settings
        self.vocab = vocab
        self.width = mask_words(vocab.vocabulary.size)
        self._backend: GuidedDecodingBackend | None = None
        self._compiled: dict[GuidedDecoding, Any] = {}

    def backend(self) -> GuidedDecodingBackend:
        """The backend; Skip when its library is missing here."""
        if self._backend is None:
            try:
                self._backend = self.cls(self.settings, vocabulary=self.vocab.vocabulary)
            except GuidedDecodingUnavailable as exc:
                raise Skip(f"unavailable here: {exc}") from None
        return self._backend

    def samples(self) -> list[Sample]:
        """The kit's constraints of the kinds the backend declares."""
        return [sample for sample in SAMPLES if sample.kind in self.cls.supported_kinds]

    def compile(self, constraint: GuidedDecoding, invariant: str = KINDS) -> Any:
        """``backend.compile(constraint)``; any exception breaks ``invariant``."""
        backend = self.backend()
        try:
            return backend.compile(constraint)
        except Exception as exc:
            raise broken(SEAM, invariant, f"{self.name}.compile({label(constraint)}) raised "
                                          f"{type(exc).__name__}: {exc}") from None

    def compiled(self, sample: Sample) -> Any:
        """The sample's constraint, compiled once per kit."""
        if sample.constraint not in self._compiled:
            self._compiled[sample.constraint] = self.compile(sample.constraint)
        return self._compiled[sample.constraint]

    def matcher(self, sample: Sample, stops: tuple[int, ...]) -> ConstraintMatcher:
        return self.backend().matcher(self.compiled(sample), stops)

    def mask(self, matcher: ConstraintMatcher) -> np.ndarray:
        """The matcher's mask row (int32 words), filled into a cleared one-row bitmask."""
        bitmask = np.zeros((1, self.width), dtype=np.int32)
        matcher.fill_mask(bitmask, 0)
        return bitmask[0]

    def describe(self, token_ids: Collection[int] | np.ndarray, most: int = 3) -> str:
        """The first ``most`` of ``token_ids``, described, and how many more."""
        listed = [self.vocab.describe(int(t)) for t in list(token_ids)[:most]]
        more = len(token_ids) - len(listed)
        return ", ".join(listed) + (f" and {more} more" if more > 0 else "")

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab.token_bytes[token_id]


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a mask row (int32 words) allows; the bits past the logits' width mean nothing."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:LOGITS_WIDTH])


def _shown(data: bytes) -> str:
    """An output in a message: its text where it decodes, its bytes otherwise; the last 60 characters."""
    text = decoded(data)
    shown: str | bytes = data if text is None else text
    return repr(shown) if len(shown) <= 60 else "..." + repr(shown[-60:])


# -- walks ------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Step:
    """Where a walk stands before it takes its next token."""

    sample: Sample
    seed: int
    stops: tuple[int, ...]
    matcher: ConstraintMatcher
    tokens: list[int]    # taken so far
    data: bytes          # their bytes
    row: np.ndarray      # the mask here (int32 words)
    ids: np.ndarray      # the ids it allows

    def where(self) -> str:
        return f"after {_shown(self.data)} ({self.sample.label}, seed {self.seed}, stop ids {list(self.stops)})"


@dataclass(slots=True)
class _Walk:
    tokens: list[int]
    rows: list[np.ndarray]   # the mask before each token
    data: bytes              # the output's bytes (the stop token's none)
    ended: bool              # a stop token ended it


def _walk(kit: _Kit, sample: Sample, seed: int, stops: tuple[int, ...],
          visit: Callable[[_Step], None] | None = None) -> _Walk:
    """Follow the mask of a fresh matcher: at each step a random allowed token, or an allowed stop id
    half the time; ``visit`` sees each step first. Breaks WALKS (or AGREES) where the walk cannot go
    on, ends without a stop, or ends with an output that does not satisfy the constraint."""
    rng = random.Random(f"{sample.kind}/{seed}")
    matcher = kit.matcher(sample, stops)
    walk = _Walk([], [], b"", ended=False)
    for _ in range(MAX_WALK if sample.ends else MAX_OPEN_WALK):
        row = kit.mask(matcher)
        step = _Step(sample, seed, stops, matcher, list(walk.tokens), walk.data, row, allowed_ids(row))
        if visit is not None:
            visit(step)
        ids = step.ids.tolist()
        if not ids:
            raise broken(SEAM, WALKS, f"{kit.name}: {step.where()} the mask allows no token")
        ending = [t for t in ids if t in stops]
        going = [t for t in ids if t not in stops]
        token = rng.choice(ending) if ending and (not going or rng.random() < 0.5) else rng.choice(going)
        if not matcher.accept(token):
            raise broken(SEAM, AGREES, f"{kit.name}: {step.where()} the mask allows {kit.describe([token])}, "
                                       f"which accept() refuses")
        walk.tokens.append(token)
        walk.rows.append(row)
        if token in stops:
            if not matcher.is_terminated():
                raise broken(SEAM, WALKS, f"{kit.name}: {step.where()} accept() took the stop {kit.describe([token])}"
                                          f" and is_terminated() is False")
            text = decoded(walk.data)
            problem = "it is not UTF-8" if text is None else sample.problem(text)
            if problem is not None:
                raise broken(SEAM, WALKS, f"{kit.name}: {step.where()} the mask allowed the stop "
                                          f"{kit.describe([token])}, and the output does not satisfy the "
                                          f"constraint: {problem}")
            walk.ended = True
            return walk
        walk.data += kit.token_bytes(token)
        if matcher.is_terminated():
            raise broken(SEAM, WALKS, f"{kit.name}: {step.where()} is_terminated() is True after "
                                      f"{kit.describe([token])}, which is no stop id")
    if sample.ends:
        raise broken(SEAM, WALKS, f"{kit.name}: a walk along the mask of {sample.label} (seed {seed}) took "
                                  f"{MAX_WALK} tokens without reaching a stop id ({_shown(walk.data)}); every "
                                  f"output of it is far shorter")
    return walk


def _walks(kit: _Kit, visit: Callable[[Sample, int], Callable[[_Step], None] | None] = lambda s, seed: None,
           samples: list[Sample] | None = None) -> list[_Walk]:
    """Every seed's walk over each sample (``samples``, else those the backend declares)."""
    return [_walk(kit, sample, seed, STOP_SETS[seed], visit(sample, seed))
            for sample in (kit.samples() if samples is None else samples) for seed in SEEDS]


def _replay(kit: _Kit, pairs: list[tuple[ConstraintMatcher, _Walk]]) -> str | None:
    """Replay each walk on its fresh matcher (same constraint, same stop ids), the walks interleaved
    step by step; where one parts from its walk, or None."""
    outputs = [b""] * len(pairs)
    for index in range(max(len(walk.tokens) for _, walk in pairs)):
        for number, (matcher, walk) in enumerate(pairs):
            if index >= len(walk.tokens):
                continue
            where = f"after {_shown(outputs[number])}"
            row = kit.mask(matcher)
            if not np.array_equal(row, walk.rows[index]):
                return f"{where} the mask differs: {_difference(kit, row, walk.rows[index])}"
            token = walk.tokens[index]
            if not matcher.accept(token):
                return f"{where} accept() refuses {kit.describe([token])}, which the first matcher took"
            outputs[number] += kit.token_bytes(token)
    for number, (matcher, walk) in enumerate(pairs):
        if matcher.is_terminated() != walk.ended:
            return f"after {_shown(outputs[number])} is_terminated() is {matcher.is_terminated()}, not {walk.ended}"
    return None


def _difference(kit: _Kit, got: np.ndarray, want: np.ndarray) -> str:
    extra = np.setdiff1d(allowed_ids(got), allowed_ids(want))
    missing = np.setdiff1d(allowed_ids(want), allowed_ids(got))
    return "; ".join(([f"it allows {kit.describe(extra)} as well"] if extra.size else [])
                     + ([f"it forbids {kit.describe(missing)}"] if missing.size else []))


# -- the checks -------------------------------------------------------------------------------

def _kinds(kit: _Kit) -> None:
    """Each declared kind's sample compiles; a sample of another kind raises ConstraintError naming it."""
    declared = kit.cls.supported_kinds
    unknown = sorted(set(declared) - set(GUIDED_KINDS))
    if unknown or not declared:
        raise broken(SEAM, KINDS, f"{kit.name}.supported_kinds is {sorted(declared)}: it declares some of "
                                  f"{', '.join(GUIDED_KINDS)}, and nothing else")
    for sample in SAMPLES:
        if sample.kind in declared:
            kit.compiled(sample)
            continue
        try:
            kit.backend().compile(sample.constraint)
        except ConstraintError as exc:
            if sample.kind not in str(exc):
                raise broken(SEAM, KINDS, f"{kit.name}.compile({sample.label}), a kind it does not declare, raised "
                                          f"ConstraintError({str(exc)!r}), which does not name the kind") from None
            continue
        except Skip:
            raise
        except Exception as exc:
            raise broken(SEAM, KINDS, f"{kit.name}.compile({sample.label}), a kind it does not declare, raised "
                                      f"{type(exc).__name__}: {exc}; want ConstraintError naming the kind") from None
        raise broken(SEAM, KINDS, f"{kit.name}.compile({sample.label}) compiled a kind its supported_kinds does "
                                  f"not declare (declare it, or raise ConstraintError naming the kind)")


def _invalid_specs(kit: _Kit) -> None:
    """Each of the kit's invalid constraints of a declared kind raises ConstraintError whose message a
    client can read (and quotes the culprit, where the constraint has one)."""
    cases = [case for case in INVALID if case.kind in kit.cls.supported_kinds]
    if not cases:
        raise Skip("the kit has no invalid constraint of the declared kinds")
    backend = kit.backend()
    for case in cases:
        try:
            backend.compile(case.constraint)
        except ConstraintError as exc:
            message = str(exc)
        except Exception as exc:
            raise broken(SEAM, INVALID_SPECS, f"{kit.name}.compile({case.label}) raised {type(exc).__name__}: {exc}; "
                                              f"want ConstraintError") from None
        else:
            raise broken(SEAM, INVALID_SPECS, f"{kit.name}.compile({case.label}) compiled a constraint that "
                                              f"cannot compile")
        problem = _message_problem(message, case.names)
        if problem is not None:
            raise broken(SEAM, INVALID_SPECS, f"{kit.name}.compile({case.label}) raised ConstraintError({message!r}): "
                                              f"{problem}")


def _message_problem(message: str, names: str | None) -> str | None:
    """What keeps an error message from a client, or None."""
    if not message.strip():
        return "the message is empty"
    if "\n" in message.strip():
        return "the message takes more than one line"
    if "Traceback" in message or _SOURCE_LOCATION.search(message):
        return "the message holds a traceback or a source location, nothing a client can act on"
    if names is not None and names.lower() not in message.lower():
        return f"the message does not name {names!r}"
    return None


def _layout(kit: _Kit) -> None:
    """On each sample's first walk: no row but the matcher's changes, a row whose bits were all set
    is written whole, and no padding id is ever allowed."""
    tokens = len(kit.vocab.vocabulary.tokens)
    for sample in kit.samples():
        walk = _walk(kit, sample, SEEDS[0], STOP_SETS[0])
        for index, row in enumerate(walk.rows):
            padding = allowed_ids(row)
            padding = padding[padding >= tokens]
            if padding.size:
                raise broken(SEAM, LAYOUT, f"{kit.name}: after {_shown(_output(kit, walk, index))} ({sample.label}) "
                                           f"the mask allows {kit.describe(padding)}: the ids from {tokens} (the "
                                           f"vocabulary's tokens) to {LOGITS_WIDTH} (the logits' width) are padding")
        matcher = kit.matcher(sample, STOP_SETS[0])
        for index, token in enumerate(walk.tokens[:4]):
            bitmask = np.full((3, kit.width), -1, dtype=np.int32)
            bitmask[0] = bitmask[2] = np.int32(SENTINEL)
            matcher.fill_mask(bitmask, 1)
            where = f"after {_shown(_output(kit, walk, index))} ({sample.label})"
            if not (bitmask[[0, 2]] == np.int32(SENTINEL)).all():
                raise broken(SEAM, LAYOUT, f"{kit.name}: {where} fill_mask(bitmask, 1) of a 3-row bitmask changed "
                                           f"row 0 or 2")
            if not np.array_equal(bitmask[1], walk.rows[index]):
                difference = _difference(kit, bitmask[1], walk.rows[index])
                raise broken(SEAM, LAYOUT, f"{kit.name}: {where} fill_mask into a row whose bits were all set and "
                                           f"into a cleared one differ ({difference}): it must write every bit of "
                                           f"its row")
            matcher.accept(token)


def _output(kit: _Kit, walk: _Walk, steps: int) -> bytes:
    """The output of the first ``steps`` tokens of ``walk``."""
    return b"".join(kit.token_bytes(token) for token in walk.tokens[:steps])


def _follows_masks(kit: _Kit) -> None:
    """Every seed's walk over each sample ends on a stop id with an output that satisfies it."""
    _walks(kit)


def _mask_vs_accept(kit: _Kit) -> None:
    """Along every walk: a few allowed tokens, replayed on a fresh matcher, are accepted; a few
    refused ones are refused and leave the mask as it was."""
    text_tokens = [token for token in range(len(kit.vocab.vocabulary.tokens)) if kit.token_bytes(token)]

    def visit(sample: Sample, seed: int) -> Callable[[_Step], None]:
        rng = random.Random(f"probe/{sample.kind}/{seed}")

        def probe(step: _Step) -> None:
            allowed = set(step.ids.tolist())
            going = sorted(allowed - set(step.stops))
            for token in rng.sample(going, min(PROBES, len(going))):
                fresh = kit.matcher(sample, step.stops)
                if not all(fresh.accept(taken) for taken in step.tokens):
                    raise broken(SEAM, AGREES, f"{kit.name}: a fresh matcher of {sample.label} refuses the tokens "
                                               f"another one took ({_shown(step.data)})")
                if not fresh.accept(token):
                    raise broken(SEAM, AGREES, f"{kit.name}: {step.where()} the mask allows "
                                               f"{kit.describe([token])}, which accept() refuses")
            refused = [token for token in text_tokens if token not in allowed]
            for token in rng.sample(refused, min(REFUSALS, len(refused))):
                if step.matcher.accept(token):
                    raise broken(SEAM, AGREES, f"{kit.name}: {step.where()} accept() takes {kit.describe([token])}, "
                                               f"which the mask forbids")
                if not np.array_equal(kit.mask(step.matcher), step.row):
                    raise broken(SEAM, AGREES, f"{kit.name}: {step.where()} accept() refused "
                                               f"{kit.describe([token])} and the mask changed: "
                                               f"{_difference(kit, kit.mask(step.matcher), step.row)}")

        return probe

    _walks(kit, visit)


def _exact_mask(kit: _Kit) -> None:
    """Where the kit knows every output (regex, choice, grammar), each mask along every walk is the
    set of text tokens that keep the output a beginning of one (the stop ids are the stop check's)."""
    samples = [sample for sample in kit.samples() if sample.words is not None]
    if not samples:
        raise Skip("the backend declares none of regex, choice, grammar")
    tokens = range(len(kit.vocab.vocabulary.tokens))

    def visit(sample: Sample, seed: int) -> Callable[[_Step], None]:
        def compare(step: _Step) -> None:
            want = {t for t in tokens if kit.token_bytes(t) and sample.continues(step.data + kit.token_bytes(t))}
            got = set(step.ids.tolist()) - {END, STOP}
            extra, missing = sorted(got - want), sorted(want - got)
            if extra:
                raise broken(SEAM, EXACT, f"{kit.name}: {step.where()} the mask allows {kit.describe(extra)}, with "
                                          f"which no output of the constraint begins")
            if missing:
                raise broken(SEAM, EXACT, f"{kit.name}: {step.where()} the mask forbids {kit.describe(missing)}, "
                                          f"with which outputs of the constraint begin")

        return compare

    _walks(kit, visit, samples)


def _stop_ids(kit: _Kit) -> None:
    """Along walks made with each set of stop ids: the special tokens a mask allows are exactly the
    matcher's stop ids where the output is complete, none elsewhere; at the first complete output of
    each sample, accept() refuses the stop id the matcher was not given."""
    refused: set[Sample] = set()   # the samples whose matcher was offered another stop id

    def visit(sample: Sample, seed: int) -> Callable[[_Step], None]:
        def compare(step: _Step) -> None:
            complete = completes(sample, step.data)
            allowed = sorted({END, STOP, OTHER} & set(step.ids.tolist()))
            want = sorted(step.stops) if complete else []
            if allowed != want:
                state = "completes the constraint" if complete else "does not complete the constraint"
                raise broken(SEAM, STOPS, f"{kit.name}: {step.where()}, which {state}, the mask allows "
                                          f"{kit.describe(allowed) if allowed else 'no special token'}; want "
                                          f"{kit.describe(want) if want else 'none'}")
            others = sorted({END, STOP} - set(step.stops))
            if complete and others and sample not in refused:
                refused.add(sample)
                if step.matcher.accept(others[0]) or step.matcher.is_terminated():
                    raise broken(SEAM, STOPS, f"{kit.name}: {step.where()} accept() takes "
                                              f"{kit.describe(others)}, which is no stop id of this matcher")

        return compare

    _walks(kit, visit)


def _valid_output(kit: _Kit) -> None:
    """Each sample's known output, written token by token through the mask (the longest allowed
    token that continues it each step; whitespace outside JSON strings where the backend's layout
    wants it), then the eos id: every step has such a token, and the eos id ends it."""
    for sample in kit.samples():
        matcher = kit.matcher(sample, (END,))
        rest, in_string, data, spaces = sample.target.encode(), False, b"", 0
        while True:
            ids = allowed_ids(kit.mask(matcher)).tolist()
            if not rest and END in ids:
                break
            best: tuple[tuple[int, int], int, bytes, bool] | None = None
            for token in ids:
                follows = _follow(rest, kit.token_bytes(token), in_string, layout=sample.layout)
                if token in (END, STOP) or not kit.token_bytes(token) or follows is None:
                    continue
                key = (len(rest) - len(follows[0]), -len(kit.token_bytes(token)))  # most of the output, least else
                if best is None or key > best[0]:
                    best = (key, token, *follows)
            if best is None or (best[0][0] == 0 and spaces >= MAX_SPACES):
                if not rest:
                    raise broken(SEAM, VALID, f"{kit.name}: {_shown(data)} is a whole output of {sample.label}, "
                                              f"and the mask allows no stop id (stop ids {[END]})")
                raise broken(SEAM, VALID, f"{kit.name}: after {_shown(data)} the mask of {sample.label} allows no "
                                          f"token that continues the valid output {sample.target!r}")
            (consumed, _), token, rest, in_string = best
            spaces = 0 if consumed else spaces + 1
            if not matcher.accept(token):
                raise broken(SEAM, AGREES, f"{kit.name}: after {_shown(data)} ({sample.label}) the mask allows "
                                           f"{kit.describe([token])}, which accept() refuses")
            data += kit.token_bytes(token)
        if not matcher.accept(END) or not matcher.is_terminated():
            raise broken(SEAM, VALID, f"{kit.name}: {_shown(data)} is a whole output of {sample.label}; accept() "
                                      f"of the stop {kit.describe([END])} did not terminate the matcher")
        assert completes(sample, data), f"the kit's target {sample.target!r} does not satisfy {sample.label}"


def _follow(rest: bytes, piece: bytes, in_string: bool, *, layout: bool) -> tuple[bytes, bool] | None:
    """What is left of the output ``rest`` once ``piece`` is written (whitespace outside JSON strings
    skipped where the layout is free), and whether that ends inside a string; None: ``piece`` does
    not continue it. The kit's outputs hold no escaped quotes."""
    for byte in piece:
        if layout and not in_string and byte in _WHITESPACE:
            continue
        if not rest or rest[0] != byte:
            return None
        rest = rest[1:]
        if layout and byte == ord('"'):
            in_string = not in_string
    return rest, in_string


def _cached(kit: _Kit) -> None:
    """A constraint compiled again (an equal, new object) replays the first one's walk mask for
    mask; a different constraint of the same kind, compiled between, starts with another mask."""
    for sample in kit.samples():
        walk = _walk(kit, sample, SEEDS[0], STOP_SETS[0])
        if sample.other is not None:
            other = GuidedDecoding(sample.kind, sample.other)
            first = kit.mask(kit.backend().matcher(kit.compile(other, CACHED), STOP_SETS[0]))
            if np.array_equal(first, walk.rows[0]):
                raise broken(SEAM, CACHED, f"{kit.name}: {sample.label} and {label(other)} give matchers with the "
                                           f"same first mask: the cache confuses different constraints")
        again = kit.compile(dataclasses.replace(sample.constraint), CACHED)
        difference = _replay(kit, [(kit.backend().matcher(again, STOP_SETS[0]), walk)])
        if difference is not None:
            raise broken(SEAM, CACHED, f"{kit.name}: {sample.label} compiled again: {difference}")


def _independent(kit: _Kit) -> None:
    """Two walks of one compiled constraint, replayed on two matchers step by step in turn, then on
    two threads at once, go exactly as each went alone."""
    stops = STOP_SETS[-1]
    for sample in kit.samples():
        walks = [_walk(kit, sample, seed, stops) for seed in SEEDS[1:]]
        difference = _replay(kit, [(kit.matcher(sample, stops), walk) for walk in walks])
        if difference is not None:
            raise broken(SEAM, INDEPENDENT, f"{kit.name}: two matchers of {sample.label}, used in turn: {difference}")
        calls = [ThreadCall(partial(_replays, kit, sample, stops, walk)).start() for walk in walks]
        for call in calls:
            if not call.join(60):
                raise broken(SEAM, INDEPENDENT, f"{kit.name}: a matcher of {sample.label} replaying a walk on a "
                                                f"thread did not finish within 60 s")
            difference = next((d for d in call.value or () if d is not None), None)
            if difference is not None:
                raise broken(SEAM, INDEPENDENT, f"{kit.name}: matchers of {sample.label} on two threads at once: "
                                                f"{difference}")


def _replays(kit: _Kit, sample: Sample, stops: tuple[int, ...], walk: _Walk) -> list[str | None]:
    """THREAD_ROUNDS replays of ``walk`` on fresh matchers, one after another."""
    return [_replay(kit, [(kit.matcher(sample, stops), walk)]) for _ in range(THREAD_ROUNDS)]


def _rollback(kit: _Kit) -> None:
    """Along every walk, at each step: accept up to :data:`ROLLBACK_RUN` of the walk's next tokens,
    roll them back, and the mask and ``is_terminated`` are those before them."""
    if not kit.cls.supports_rollback:
        raise Skip("the backend does not declare supports_rollback")
    for walk, (sample, seed) in zip(_walks(kit), ((s, seed) for s in kit.samples() for seed in SEEDS), strict=True):
        matcher = kit.matcher(sample, STOP_SETS[seed])
        for index, token in enumerate(walk.tokens):
            run = walk.tokens[index:index + ROLLBACK_RUN]
            for taken in run:
                if not matcher.accept(taken):
                    raise broken(SEAM, ROLLBACK, f"{kit.name}: {sample.label}, seed {seed}: accept() refuses "
                                                 f"{kit.describe([taken])} of a walk it took before")
            matcher.rollback(len(run))
            row = kit.mask(matcher) if not matcher.is_terminated() else None
            if row is None or not np.array_equal(row, walk.rows[index]):
                raise broken(SEAM, ROLLBACK, f"{kit.name}: {sample.label}, seed {seed}: after {index} tokens, "
                                             f"{len(run)} accepted and rolled back leave "
                                             + ("it terminated" if row is None else
                                                f"another mask: {_difference(kit, row, walk.rows[index])}"))
            matcher.accept(token)


GUIDED_DECODING_CHECKS: Final = (
    Check("kinds", KINDS, _kinds),
    Check("invalid_specs", INVALID_SPECS, _invalid_specs),
    Check("bitmask", LAYOUT, _layout),
    Check("walks", WALKS, _follows_masks),
    Check("mask_vs_accept", AGREES, _mask_vs_accept),
    Check("exact_mask", EXACT, _exact_mask),
    Check("stop_ids", STOPS, _stop_ids),
    Check("valid_output", VALID, _valid_output),
    Check("cached", CACHED, _cached),
    Check("independent", INDEPENDENT, _independent),
    Check("rollback", ROLLBACK, _rollback),
)
