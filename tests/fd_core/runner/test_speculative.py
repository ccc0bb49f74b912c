"""Verification of proposed tokens: greedy keeps the model's own choices, rejection sampling keeps
the model's distribution exactly (chi-square against the target distribution)."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.request import SamplingParams
from fd_core.runner.speculative import verify

#: The chi-square statistic's value that a true fit exceeds with probability 0.001, by degrees of freedom.
CHI_SQUARE_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}

#: One target distribution over six tokens.
PROBS = np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])


def _fits(observed: np.ndarray, expected: np.ndarray) -> bool:
    """Whether counts ``observed`` fit ``expected`` (chi-square goodness of fit at p = 0.001)."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic < CHI_SQUARE_CRITICAL_0_001[len(observed) - 1]


def _logits(rows: list[np.ndarray]) -> np.ndarray:
    return np.log(np.stack(rows)).astype(np.float32)


def test_greedy_accepts_the_models_own_choices_then_corrects():
    raw = np.zeros((4, 8), np.float32)
    raw[0, 3] = raw[1, 5] = raw[2, 6] = raw[3, 1] = 5.0   # the model's argmax per position: 3, 5, 6, 1
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    assert [t.token_id for t in verify(raw, [3, 5, 6], greedy, rng)] == [3, 5, 6, 1]   # all accepted + bonus
    assert [t.token_id for t in verify(raw, [3, 4, 6], greedy, rng)] == [3, 5]         # second rejected
    assert [t.token_id for t in verify(raw, [2, 5, 6], greedy, rng)] == [3]            # first rejected


def test_logprobs_are_the_raw_distributions_of_each_position():
    raw = _logits([PROBS, PROBS[::-1]])
    tokens = verify(raw, [0], SamplingParams(temperature=0.0, logprobs=2), np.random.default_rng(0))
    assert [t.token_id for t in tokens] == [0, 5]
    assert tokens[0].logprob == pytest.approx(np.log(PROBS[0]), abs=1e-5)
    assert tokens[1].logprob == pytest.approx(np.log(PROBS[0]), abs=1e-5)   # token 5 of the reversed row
    assert [t for t, _ in tokens[1].top_logprobs] == [5, 4]


@pytest.mark.parametrize("guess", [0, 3, 5])
@pytest.mark.parametrize("params, kept", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=1.0, top_p=0.85), np.where(np.arange(6) < 4, PROBS, 0.0)),   # drops 4 and 5
    (SamplingParams(temperature=1.0, top_k=3), np.where(np.arange(6) < 3, PROBS, 0.0)),
])
def test_rejection_sampling_keeps_the_target_distribution(params, kept, guess):
    """Whatever the proposal (likely, unlikely, or one the filters drop), the first token follows the
    filtered target distribution, and the second position's token follows it too after an acceptance."""
    target = kept / kept.sum()
    raw = _logits([PROBS, PROBS])
    rng = np.random.default_rng(guess)
    draws = 8000
    first = np.zeros(6)
    second = np.zeros(6)
    for _ in range(draws):
        tokens = [t.token_id for t in verify(raw, [guess], params, rng)]
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    assert first.sum() == draws
    keep = target > 0
    assert not first[~keep].any()
    assert _fits(first[keep], target[keep] * draws)
    accepted = second.sum()
    assert accepted == first[guess] and (accepted == 0) == (target[guess] == 0)
    if accepted:
        assert _fits(second[keep], target[keep] * accepted)
