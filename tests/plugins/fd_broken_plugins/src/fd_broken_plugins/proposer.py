"""A proposer that proposes up to ``max_proposed_tokens`` whatever the step's budget (breaks "one list per
request, at most its budget long")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import fd_core
from fd_plugins.proposers.ngram import NgramProposer

if TYPE_CHECKING:
    from fd_core.request import Request


class IgnoresBudgets(NgramProposer):
    """The ngram proposer, asked for ``max_proposed_tokens`` tokens of every request."""

    name: ClassVar[str] = "ignores-budgets"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return super().propose(requests, [self.max_proposed_tokens] * len(requests))
