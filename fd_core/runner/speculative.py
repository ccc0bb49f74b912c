"""Verification of proposed tokens (speculative decoding): which a row accepts, and the token after.

A row that computed ``s`` proposed tokens ``d_1 .. d_s`` after its last known token has ``s + 1``
logits rows: row ``j`` is the model's distribution ``p_j`` for the token at ``d_{j+1}``'s position,
row ``s`` the one for the token after ``d_s``.

* **Greedy** rows accept ``d_{j+1}`` while it is the argmax of row ``j``; the next token is the
  argmax of the first row that disagreed (or of row ``s``): exactly the tokens one-at-a-time greedy
  decoding gives.
* **Sampled** rows (temperature, top-k, top-p, min-p) use rejection sampling. A proposer's guess is a
  point mass ``q = 1[d]``, so ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q(d)) =
  p_j(d)``; on rejection the token is drawn from the residual ``max(p_j - q, 0)``, renormalised:
  ``p_j`` without ``d``. After ``s`` acceptances one more token is drawn from ``p_s``. Each output
  token is then distributed exactly as ``p_j`` (Leviathan et al., 2023; Chen et al., 2023).
  ``p_j`` is what the sampler draws from: the logits divided by the temperature, with the tokens
  :func:`~fd_core.runner.sampling.filter_thresholds` drops removed.

A constraint (guided decoding) removes the tokens it forbids at each position, as the sampler's mask
does, before either rule: a proposal it forbids is never accepted. Rows with penalties, a logit bias
or a seed are never verified (``SamplingParams.speculable``). Logprobs are the raw distribution's,
as the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fd_core.outputs import SampledToken
from fd_core.runner.sampling import filter_thresholds, token_logprobs

if TYPE_CHECKING:
    from fd_core.request import SamplingParams


def verify(raw: np.ndarray, proposed: Sequence[int], params: SamplingParams, rng: np.random.Generator, *,
           forbidden: np.ndarray | None = None) -> list[SampledToken]:
    """The tokens a row outputs this step: the accepted prefix of ``proposed`` then one token from
    the model, given its float32 logits ``raw`` [len(proposed) + 1, V] (see the module docstring).
    ``forbidden`` (bool, the same shape) removes tokens a constraint forbids at each position."""
    assert raw.shape[0] == len(proposed) + 1, (raw.shape, len(proposed))
    shaped = raw if forbidden is None else np.where(forbidden, -np.inf, raw).astype(np.float32)
    tokens = _greedy(shaped, proposed) if params.greedy else _sampled(shaped, proposed, params, rng)
    if params.logprobs is None:
        return [SampledToken(t) for t in tokens]
    return token_logprobs(raw[:len(tokens)], np.asarray(tokens, np.int64), [params.logprobs] * len(tokens))


def _greedy(raw: np.ndarray, proposed: Sequence[int]) -> list[int]:
    best = raw.argmax(axis=-1)
    accepted = 0
    while accepted < len(proposed) and best[accepted] == proposed[accepted]:
        accepted += 1
    return [*proposed[:accepted], int(best[accepted])]


def _sampled(raw: np.ndarray, proposed: Sequence[int], params: SamplingParams,
             rng: np.random.Generator) -> list[int]:
    scaled = raw / np.float32(params.temperature)
    thresholds = filter_thresholds(scaled, [params] * raw.shape[0])
    kept = scaled >= thresholds[:, None]
    probs = np.exp(scaled.astype(np.float64) - scaled.max(axis=-1, keepdims=True))
    probs[~kept] = 0.0
    probs /= probs.sum(axis=-1, keepdims=True)
    tokens: list[int] = []
    for j, guess in enumerate(proposed):
        if rng.random() < probs[j, guess]:
            tokens.append(int(guess))
            continue
        residual = probs[j].copy()
        residual[guess] = 0.0   # p_j(guess) < 1 here, so some mass is left
        tokens.append(_draw(residual, rng))
        return tokens
    tokens.append(_draw(probs[len(proposed)], rng))
    return tokens


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn in proportion to ``weights`` (float64, >= 0, not all 0) by inverse CDF."""
    cdf = np.cumsum(weights)
    pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if pick >= len(cdf):   # rounding put the target at the total: the last token with weight
        pick = int(np.flatnonzero(weights)[-1])
    return pick
