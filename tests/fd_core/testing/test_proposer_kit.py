"""The proposer kit fails a proposer that breaks one rule, naming the proposer and the rule."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from fd_core.request import Request
from fd_core.testing.conformance import PROPOSER_CHECKS, ConformanceError, check_proposer, run_proposer_checks
from fd_plugins.proposers.ngram import NgramProposer


class IgnoresBudgets(NgramProposer):
    """Proposes up to max_proposed_tokens whatever the step's budget."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return super().propose(requests, [self.max_proposed_tokens] * len(requests))


class SkipsEmptyRows(NgramProposer):
    """Leaves out the requests it proposes nothing for."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return [proposal for proposal in super().propose(requests, budgets) if proposal]


class NumpyIds(NgramProposer):
    """Hands out numpy integers."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return [list(np.array(proposal, dtype=np.int64)) for proposal in super().propose(requests, budgets)]


class PastTheVocabulary(NgramProposer):
    """Proposes vocab_size itself where it has nothing better."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return [proposal or [self.vocab_size] for proposal in super().propose(requests, budgets)]


class SeededPerInstance(NgramProposer):
    """Proposes a token that depends on which instance it is."""

    instances = itertools.count()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.serial = next(self.instances)

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return [[self.serial % self.vocab_size] for _ in requests]


class RepeatsItsFirstGuess(NgramProposer):
    """Keeps the first proposal of each request, whatever its tokens become."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        first = self.__dict__.setdefault("first", {})
        fresh = super().propose(requests, budgets)
        return [first.setdefault(r.request_id, p)[:b] for r, p, b in zip(requests, fresh, budgets, strict=True)]


class AppendsItsGuess(NgramProposer):
    """Writes its proposal into the request's outputs, as if it were accepted."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        proposals = super().propose(requests, budgets)
        for request, proposal in zip(requests, proposals, strict=True):
            request.output_token_ids.extend(proposal)
        return proposals


class ForgetsStrictly(NgramProposer):
    """Raises KeyError when told to forget a request it holds nothing for."""

    def forget(self, request_id: str) -> None:
        del self._requests[request_id]


def _case(cls: type, check: str, *words: str) -> Any:
    return pytest.param(cls, check, words, id=f"{cls.__name__}-{check}")


@pytest.mark.parametrize(("cls", "check", "words"), [
    _case(IgnoresBudgets, "budgets", "proposer invariant 'one list per request, at most its budget long' broken: "
                                     "IgnoresBudgets proposed 4 tokens for request 'r4' with a budget of 2: [",
          "] (seed 0, step 0, max_proposed_tokens 4)"),
    _case(SkipsEmptyRows, "budgets", "broken: SkipsEmptyRows.propose() for 19 requests returned list of ",
          " entries (seed 0, step 0, max_proposed_tokens 1)"),
    _case(NumpyIds, "token_ids", "proposer invariant 'proposed ids are ints in [0, vocab_size)' broken: NumpyIds "
                                 "proposed np.int64(", "(int64) for request ", "; vocab_size is 1000 (seed 0, step 0, "
                                 "max_proposed_tokens 16)"),
    _case(PastTheVocabulary, "token_ids", "broken: PastTheVocabulary proposed 1000 (int) for request 'r1'; "
                                          "vocab_size is 1000"),
    _case(SeededPerInstance, "deterministic", "proposer invariant 'the same calls give the same proposals' broken: "
                                              "two fresh SeededPerInstance given the same calls differ at proposal 0 "
                                              "(seed 0): request 'r1' got ["),
    _case(RepeatsItsFirstGuess, "rebuilds", "proposer invariant 'without observe(), proposals depend on the tokens "
                                            "alone, however they came' broken: RepeatsItsFirstGuess proposed ",
          "after watching the requests grow step by step; a fresh one proposes "),
    _case(AppendsItsGuess, "unchanged", "proposer invariant 'propose, observe and forget leave the requests as they "
                                        "were' broken: AppendsItsGuess.propose() for ", " changed request ",
          ": output_token_ids"),
    _case(ForgetsStrictly, "unknown_ids", "proposer invariant 'observe() and forget() take requests never proposed "
                                          "for, or forgotten' broken: ForgetsStrictly.forget('never-proposed') raised "
                                          "KeyError: 'never-proposed'"),
])
def test_a_proposer_that_breaks_a_rule_fails_naming_itself_and_the_rule(cls, check, words):
    report = run_proposer_checks(cls)
    result = report.result(check)
    assert result.status == "failed" and all(part in result.reason for part in words), result.reason
    assert report.plugin == cls.__name__


def test_check_proposer_raises_for_the_broken_and_lists_every_check():
    assert [check.name for check in PROPOSER_CHECKS] == [
        "budgets", "token_ids", "empty", "deterministic", "rebuilds", "unchanged", "unknown_ids"]
    with pytest.raises(ConformanceError, match="at most its budget long") as caught:
        check_proposer(IgnoresBudgets)
    assert caught.value.seam == "proposer"
    assert check_proposer(NgramProposer, skip={"rebuilds"}).result("rebuilds").status == "skipped"
