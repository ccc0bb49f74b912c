"""The guided-decoding kit fails a backend that breaks one rule, naming the backend and the rule, and
passes one that declares fewer kinds; a backend whose library is missing is skipped, naming why."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from fd_core.contracts.guided_decoding import ConstraintError, GuidedDecodingUnavailable
from fd_core.testing.conformance import (
    GUIDED_DECODING_CHECKS,
    ConformanceError,
    check_guided_decoding,
    kit_vocabulary,
    run_guided_decoding_checks,
)
from fd_plugins.guided_decoding.xgrammar_backend import XGrammarBackend, XGrammarMatcher

pytest.importorskip("xgrammar")

#: The kit vocabulary's token for "~", which no constraint of the kit lets through but inside a JSON string.
TILDE = kit_vocabulary().vocabulary.tokens.index("~")


class LeakyMask(XGrammarBackend):
    """Its masks also allow "~", wherever they are."""

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> XGrammarMatcher:
        return _Leaky(super().matcher(compiled, stop_token_ids)._matcher)


class _Leaky(XGrammarMatcher):
    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        super().fill_mask(bitmask, row)
        bitmask[row, TILDE // 32] |= np.int32(1 << (TILDE % 32))


class RaisesValueError(XGrammarBackend):
    """Refuses a constraint with ValueError, not ConstraintError."""

    def compile(self, constraint: Any) -> Any:
        try:
            return super().compile(constraint)
        except ConstraintError as exc:
            raise ValueError(str(exc)) from None


class OrsIntoTheRow(XGrammarBackend):
    """Sets the allowed bits in the row without clearing the others."""

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> XGrammarMatcher:
        return _Oring(super().matcher(compiled, stop_token_ids)._matcher)


class _Oring(XGrammarMatcher):
    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        scratch = np.zeros_like(bitmask)
        super().fill_mask(scratch, row)
        bitmask[row] |= scratch[row]


class CachesByKind(XGrammarBackend):
    """Caches compiled constraints by kind alone: a second regex gets the first one's."""

    def compile(self, constraint: Any) -> Any:
        cache = self.__dict__.setdefault("by_kind", {})
        if constraint.kind not in cache:
            cache[constraint.kind] = super().compile(constraint)
        return cache[constraint.kind]


class PoolsMatchers(XGrammarBackend):
    """Hands out one xgrammar matcher per constraint and stop ids, reset for each new matcher."""

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> XGrammarMatcher:
        pool = self.__dict__.setdefault("pool", {})
        key = (id(compiled), stop_token_ids)
        if key not in pool:
            pool[key] = super().matcher(compiled, stop_token_ids)
        pool[key]._matcher.reset()
        return pool[key]


class UndeclaredTags(XGrammarBackend):
    """Compiles structural tags without declaring them."""

    supported_kinds: ClassVar[frozenset[str]] = XGrammarBackend.supported_kinds - {"structural_tag"}


class SourceInErrors(XGrammarBackend):
    """Passes the library's source location on to the client."""

    def compile(self, constraint: Any) -> Any:
        try:
            return super().compile(constraint)
        except ConstraintError as exc:
            raise ConstraintError(f"[10:42:07] /project/cpp/grammar_parser.cc:88: {exc}") from None


class IgnoresRollback(XGrammarBackend):
    """Declares rollback, and its matchers' rollback does nothing."""

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> XGrammarMatcher:
        return _Forgetful(super().matcher(compiled, stop_token_ids)._matcher)


class _Forgetful(XGrammarMatcher):
    def rollback(self, num_tokens: int) -> None:
        pass


def _case(cls: type, check: str, *words: str) -> Any:
    return pytest.param(cls, check, words, id=f"{cls.__name__}-{check}")


@pytest.mark.parametrize(("cls", "check", "words"), [
    _case(LeakyMask, "mask_vs_accept", "guided decoding invariant 'every token the mask allows is accepted; a refused "
                                       "token changes nothing' broken: LeakyMask: after '' (json '{\"type\": ",
          f"seed 0, stop ids [0]) the mask allows token {TILDE} (b'~'), which accept() refuses"),
    _case(LeakyMask, "exact_mask", f"broken: LeakyMask: after '' (regex '(ab|cd)-[0-9]{{1,3}}', seed 0, stop ids [0]) "
                                   f"the mask allows token {TILDE} (b'~'), with which no output of the constraint "
                                   f"begins"),
    _case(RaisesValueError, "invalid_specs", "guided decoding invariant 'a constraint that does not compile raises "
                                             "ConstraintError with a one-line message' broken: RaisesValueError."
                                             "compile(json '{\"type\": \"object\", \"properties\": {') raised "
                                             "ValueError: the JSON schema is not JSON: "),
    _case(OrsIntoTheRow, "bitmask", "guided decoding invariant 'fill_mask writes every bit of its int32 row and no "
                                    "other row; padding ids stay clear' broken: OrsIntoTheRow: after '' (json ",
          "fill_mask into a row whose bits were all set and into a cleared one differ (it allows token 0 (<|end|>), "
          "token 1 (<|stop|>), token 2 (<|tool|>) and ", " more as well): it must write every bit of its row"),
    _case(CachesByKind, "cached", "guided decoding invariant 'an equal constraint compiled again behaves the same; a "
                                  "different one does not' broken: CachesByKind: json '{\"type\": \"object\", ",
          "give matchers with the same first mask: the cache confuses different constraints"),
    _case(PoolsMatchers, "independent", "guided decoding invariant 'matchers of one compiled constraint share no "
                                        "state, also on two threads' broken: PoolsMatchers: two matchers of json "),
    _case(UndeclaredTags, "kinds", "guided decoding invariant 'declared kinds compile; another kind is refused, "
                                   "naming it' broken: UndeclaredTags.compile(structural_tag '{\"type\": "
                                   "\"structural_tag\", ",
          "compiled a kind its supported_kinds does not declare (declare it, or raise ConstraintError naming the "
          "kind)"),
    _case(IgnoresRollback, "rollback", "guided decoding invariant 'rollback(n) returns a matcher to its state n "
                                       "tokens before (supports_rollback)' broken: IgnoresRollback: ", "rolled back"),
    _case(SourceInErrors, "invalid_specs", "broken: SourceInErrors.compile(json '{\"type\": \"object\", "
                                           "\"properties\": {') raised ConstraintError('[10:42:07] /project/cpp/"
                                           "grammar_parser.cc:88: the JSON schema is not JSON: ",
          "the message holds a traceback or a source location, nothing a client can act on"),
])
def test_a_backend_that_breaks_a_rule_fails_naming_itself_and_the_rule(cls, check, words):
    report = run_guided_decoding_checks(cls)
    result = report.result(check)
    assert result.status == "failed" and all(part in result.reason for part in words), result.reason
    assert report.plugin == cls.__name__


def test_a_backend_that_ignores_the_stop_ids_is_caught(broken_plugins):
    report = run_guided_decoding_checks(broken_plugins.guided_decoding.IgnoresStopIds)
    detail = report.result("stop_ids").detail
    assert detail.startswith("IgnoresStopIds: after '{\"name\": ") and detail.endswith(
        "seed 1, stop ids [1]), which completes the constraint, the mask allows token 0 (<|end|>); want token 1 "
        "(<|stop|>)"), detail
    assert report.result("walks").detail.endswith(
        "stop ids [1]) is_terminated() is True after token 0 (<|end|>), which is no stop id")


@pytest.mark.parametrize(("cls", "checks"), [
    (RaisesValueError, ["invalid_specs"]),
    (SourceInErrors, ["invalid_specs"]),
    (OrsIntoTheRow, ["bitmask"]),
    (UndeclaredTags, ["kinds"]),
    (IgnoresRollback, ["rollback"]),
    (CachesByKind, ["invalid_specs", "cached"]),   # an invalid schema gets the valid one's compiled form
])
def test_a_backend_breaking_one_rule_fails_those_checks_alone(cls, checks):
    assert [r.check for r in run_guided_decoding_checks(cls).failures] == checks


def test_check_raises_naming_the_first_broken_invariant():
    with pytest.raises(ConformanceError) as caught:
        check_guided_decoding(RaisesValueError)
    assert caught.value.seam == "guided_decoding"
    assert caught.value.invariant == "a constraint that does not compile raises ConstraintError with a one-line message"


class JsonOnly(XGrammarBackend):
    """Declares the JSON kinds and refuses the others, naming them."""

    supported_kinds: ClassVar[frozenset[str]] = frozenset({"json", "json_object"})

    def compile(self, constraint: Any) -> Any:
        if constraint.kind not in self.supported_kinds:
            raise ConstraintError(f"this backend does not compile {constraint.kind} constraints")
        return super().compile(constraint)


def test_a_backend_of_fewer_kinds_passes_with_the_exact_mask_skipped():
    report = check_guided_decoding(JsonOnly)
    assert {r.check: r.status for r in report.results if r.status != "passed"} == {"exact_mask": "skipped"}
    assert report.result("exact_mask").reason == "the backend declares none of regex, choice, grammar"


class Unavailable(XGrammarBackend):
    def __init__(self, settings: Any, *, vocabulary: Any) -> None:
        raise GuidedDecodingUnavailable("the unicorn library is missing: pip install unicorn")


def test_a_backend_whose_library_is_missing_is_skipped_naming_why():
    report = check_guided_decoding(Unavailable)
    assert {(r.status, r.reason) for r in report.results} == {
        ("skipped", "unavailable here: the unicorn library is missing: pip install unicorn")}
    assert len(report.results) == len(GUIDED_DECODING_CHECKS)
