"""The ngram proposer: finds what followed the longest, most recent earlier match, within the budget; adapts
how much it proposes to what is accepted; rebuilds from the request's tokens; passes the proposer kit."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from pydantic import ValidationError

from fd_core.request import Request
from fd_core.testing.conformance import check_proposer
from fd_plugins.proposers.adaptive import RETRY_EVERY
from fd_plugins.proposers.ngram import NgramProposer, NgramSettings
from fd_plugins.proposers.prompt_lookup import continuation

VOCAB = 1000


def _proposer(most: int = 4, **options: object) -> NgramProposer:
    return NgramProposer(NgramSettings(**options), max_proposed_tokens=most, vocab_size=VOCAB)


def _request(prompt: list[int], outputs: list[int] | None = None, request_id: str = "r") -> Request:
    return Request(request_id, list(prompt), output_token_ids=list(outputs or []))


def _one(proposer: NgramProposer, request: Request, budget: int = 4) -> list[int]:
    [proposal] = proposer.propose([request], [budget])
    return proposal


def test_it_proposes_what_followed_the_last_tokens_earlier():
    text = [10, 11, 12, 13, 14, 15, 16, 90, 91, 11, 12]
    assert _one(_proposer(), _request(text)) == [13, 14, 15, 16]
    assert _one(_proposer(), _request(text[:7], text[7:])) == [13, 14, 15, 16]   # outputs count as much


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    # "7 1 2" occurs early (then 50); "1 2" alone occurs later (then 60); the suffix is "7 1 2"
    text = [7, 1, 2, 50, 51, 8, 1, 2, 60, 61, 7, 1, 2]
    assert _one(_proposer(max_n=3), _request(text), budget=2) == [50, 51]
    assert _one(_proposer(max_n=2), _request(text), budget=2) == [60, 61]


def test_of_equal_matches_the_most_recent_wins():
    text = [1, 2, 30, 5, 1, 2, 40, 6, 1, 2]
    assert _one(_proposer(), _request(text), budget=1) == [40]


def test_the_budget_bounds_the_proposal_and_a_run_into_the_end_repeats_with_the_match_period():
    text = [5, 6, 7, 8, 9, 20, 21, 5, 6]
    assert [len(_one(_proposer(), _request(text), budget)) for budget in (1, 2, 3, 4)] == [1, 2, 3, 4]
    # "x y z x y": "x y" occurred 3 tokens earlier, so the text is taken to repeat "z x y"
    assert _one(_proposer(8), _request([3, 1, 2, 9, 1, 2]), budget=8) == [9, 1, 2, 9, 1, 2, 9, 1]


def test_no_match_proposes_nothing():
    assert _one(_proposer(), _request(list(range(100)))) == []
    assert _one(_proposer(min_n=3), _request([1, 2, 5, 6, 1, 2])) == []   # only a 2-gram repeats
    assert _one(_proposer(), _request([4])) == [] and _one(_proposer(), _request([4, 4])) == []
    assert _one(_proposer(min_n=1), _request([4, 4]), budget=3) == [4, 4, 4]


def _brute_force(tokens: list[int], min_n: int, max_n: int, budget: int) -> list[int]:
    """The rule written out: for n from max_n down, the most recent earlier end of the last n tokens."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[size - n:]:
                follow = tokens[end + 1:]
                return [follow[i % len(follow)] for i in range(budget)]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_the_vectorised_lookup_agrees_with_the_rule_written_out(seed):
    rng = random.Random(seed)
    for _ in range(300):
        alphabet = rng.choice((2, 3, 5, 20))   # small alphabets: many matches of every length
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        budget = rng.randint(1, 8)
        got = continuation(np.array(tokens, dtype=np.int64), min_n=min_n, max_n=max_n, budget=budget)
        assert got == _brute_force(tokens, min_n, max_n, budget), (tokens, min_n, max_n, budget)


def _repeating(request_id: str = "r") -> Request:
    return _request([1, 2, 3, 4, 5] * 20, request_id=request_id)


def test_rejections_shrink_the_proposals_to_a_pause_with_a_probe_and_acceptances_grow_them_back():
    proposer, request = _proposer(), _repeating()
    sizes: list[int] = []
    while 0 not in sizes:   # every token rejected: fewer each time, then none
        assert len(sizes) < 20, sizes
        proposal = _one(proposer, request)
        sizes.append(len(proposal))
        proposer.observe(request, len(proposal), 0)   # nothing proposed: nothing verified, ignored
    assert sizes[0] == 4 and sizes[:-1] == sorted(sizes[:-1], reverse=True) and min(sizes[:-1]) == 1, sizes
    assert [_one(proposer, request) for _ in range(RETRY_EVERY - 2)] == [[]] * (RETRY_EVERY - 2)
    grown = []
    for _ in range(6):   # the probe, then every token accepted
        proposal = _one(proposer, request)
        grown.append(len(proposal))
        proposer.observe(request, len(proposal), len(proposal))
    assert grown[0] == 1 and grown == sorted(grown) and grown[-1] == 4, grown
    assert len(_one(proposer, _repeating("other"))) == 4   # another request keeps its own estimate


def test_without_adaptive_rejections_change_nothing():
    proposer, request = _proposer(adaptive=False), _repeating()
    for _ in range(20):
        assert len(_one(proposer, request)) == 4
        proposer.observe(request, 4, 0)


def test_forget_drops_the_estimate():
    proposer, request = _proposer(), _repeating()
    for _ in range(8):
        proposer.observe(request, len(_one(proposer, request)), 0)
    assert _one(proposer, request) == []
    proposer.forget("r")
    assert len(_one(proposer, request)) == 4


def test_it_rebuilds_when_the_tokens_do_not_extend_those_it_saw():
    proposer = _proposer()
    request = _request([1, 2, 3, 4, 9, 9, 1, 2])
    assert _one(proposer, request) == [3, 4, 9, 9]
    request.output_token_ids += [3, 4]   # an extension: new outputs appended
    assert _one(proposer, request) == [9, 9, 1, 2] == _one(_proposer(), request)
    request.output_token_ids[:] = [9, 9]   # replaced under the same id
    assert _one(proposer, request) == [1, 2, 9, 9] == _one(_proposer(), request)
    request.prompt_token_ids[6] = 7   # a prompt token changed
    assert _one(proposer, request) == [7, 2, 9, 9] == _one(_proposer(), request)
    del request.output_token_ids[-1]  # cut back
    assert _one(proposer, request) == _one(_proposer(), request)


@pytest.mark.parametrize(("options", "message"), [
    ({"min_n": 3, "max_n": 2}, "max_n\n  Value error, must be at least min_n (3), got 2"),
    ({"min_n": 0}, "min_n\n  Input should be greater than or equal to 1"),
    ({"max_n": 17}, "max_n\n  Input should be less than or equal to 16"),
    ({"window": 8}, "window\n  Extra inputs are not permitted"),
])
def test_bad_options_are_refused_naming_them(options, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        NgramSettings(**options)


@pytest.mark.parametrize("options", [None, {"min_n": 1, "max_n": 8, "adaptive": False}])
def test_ngram_passes_every_check_of_the_proposer_kit(options):
    report = check_proposer(NgramProposer, options=options)
    assert [r.status for r in report.results] == ["passed"] * len(report.results), report
