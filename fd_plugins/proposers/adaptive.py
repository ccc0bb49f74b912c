"""How many tokens to propose for one request, from how many of its earlier proposals were accepted.

A proposal the model rejects costs a step the work of computing it and gains nothing, so a
request whose proposals keep failing should be asked for fewer, then none; one whose proposals
pass should get the whole budget. The rule (:class:`AdaptiveBudget`):

* The acceptance estimate ``a`` starts at 1 (a new request gets the whole budget). After each
  verified proposal of ``p`` tokens of which ``k`` were accepted, ``a += WEIGHT * (k / p - a)``:
  an exponential average that forgets a step's share by ``1 - WEIGHT`` each later step.
* The request may propose ``floor(a * (most + 1))`` tokens, at most the step's budget, where
  ``most`` is ``proposer.num_speculative_tokens``: with ``most = 4``, ``a >= 0.8`` allows 4,
  ``a >= 0.6`` 3, ``a >= 0.4`` 2, ``a >= 0.2`` 1.
* Below that (``a < 1 / (most + 1)``) it is paused: it proposes nothing, but every
  :data:`RETRY_EVERY`-th call while paused allows one token, a probe. An accepted probe raises
  ``a`` by ``WEIGHT * (1 - a)`` (with ``most = 4``, at once past 0.2: one token a step again, and
  more as later ones pass); a rejected one lowers it, and the pause goes on.
"""

from __future__ import annotations

from typing import Final

#: Weight of the latest step in the acceptance estimate.
WEIGHT: Final = 0.3
#: While paused, one call in this many proposes a single token.
RETRY_EVERY: Final = 8


class AdaptiveBudget:
    """One request's acceptance estimate and the number of tokens it may propose (see the module)."""

    __slots__ = ("_most", "_paused_calls", "acceptance")

    def __init__(self, most: int) -> None:
        self._most = most             # proposer.num_speculative_tokens
        self.acceptance = 1.0         # exponential average of accepted / proposed tokens
        self._paused_calls = 0        # calls since the last probe, while paused

    def allow(self, budget: int) -> int:
        """Tokens to propose on this call, at most ``budget`` (0: none); counts a call while paused."""
        allowed = min(budget, int(self.acceptance * (self._most + 1)))
        if allowed:
            return allowed
        self._paused_calls += 1
        if self._paused_calls < RETRY_EVERY:
            return 0
        self._paused_calls = 0
        return 1

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """``num_accepted`` of ``num_proposed`` verified tokens were accepted (nothing verified: no change)."""
        if num_proposed > 0:
            rate = min(max(num_accepted, 0), num_proposed) / num_proposed
            self.acceptance += WEIGHT * (rate - self.acceptance)
