"""Tests that the conformance kit catches broken resource managers (and passes a sound one)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fd_core.outputs import StepPlan
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request
from fd_core.testing.conformance import ConformanceError, check_resource_manager
from fd_plugins.resource_managers.v1.manager import V1ResourceManager

HOOKS = Registry.from_plugins({}).hooks


def _v1_with(limits_for_manager: Any) -> Any:
    return lambda lim: V1ResourceManager(None, limits=limits_for_manager(lim), hooks=HOOKS)


class _LeakOnAbort(V1ResourceManager):
    """Forgets the blocks of aborted requests."""

    def finish_requests(self, requests: list[Request], reason: FinishReason) -> None:
        if reason is FinishReason.ABORT:
            for request in requests:
                self.tables.pop(request.request_id, None)
        super().finish_requests(requests, reason)


class _ForgetsToAdvance(V1ResourceManager):
    """Plans rows but leaves num_computed_tokens where it was."""

    def schedule(self):  # type: ignore[override]
        plan = super().schedule()
        for row in plan.scheduled:
            row.request.num_computed_tokens = row.start
        return plan


def test_a_sound_manager_passes():
    report = check_resource_manager(_v1_with(lambda lim: lim), seed=1)
    assert report.steps > 0 and report.num_requests == 32


@pytest.mark.parametrize(("factory", "rule"), [
    (_v1_with(lambda lim: dataclasses.replace(lim, max_num_batched_tokens=lim.max_num_batched_tokens * 3)),
     "max_num_batched_tokens"),
    (_v1_with(lambda lim: dataclasses.replace(lim, max_num_seqs=lim.max_num_seqs * 3)), "max_num_seqs"),
    (lambda lim: _LeakOnAbort(None, limits=lim, hooks=HOOKS), "leak or double free"),
    (lambda lim: _ForgetsToAdvance(None, limits=lim, hooks=HOOKS), "num_computed_tokens"),
])
def test_broken_managers_are_caught(factory: Any, rule: str):
    with pytest.raises(ConformanceError, match=rule):
        check_resource_manager(factory, seed=1, num_requests=60, abort_prob=0.2)


class _NeverSchedules(V1ResourceManager):
    def schedule(self):  # type: ignore[override]
        return StepPlan()


def test_a_stuck_manager_is_reported_as_not_draining():
    with pytest.raises(ConformanceError, match="not drained"):
        check_resource_manager(lambda lim: _NeverSchedules(None, limits=lim, hooks=HOOKS), seed=1, max_steps=50)
