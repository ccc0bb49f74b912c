"""Fixtures for the resource-manager tests: a hook relay and a one-step simulated engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fd_core.contracts.resource_manager import ResourceManager
from fd_core.outputs import StepPlan
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams


@pytest.fixture
def hooks() -> Any:
    """The hook relay with no hook implementations (every decision takes its default)."""
    return Registry.from_plugins({}).hooks


@pytest.fixture
def make_request() -> Callable[..., Request]:
    def make(rid: str, prompt: list[int] | int, max_tokens: int = 16) -> Request:
        tokens = list(range(prompt)) if isinstance(prompt, int) else prompt
        return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))
    return make


@pytest.fixture
def step() -> Callable[[ResourceManager], StepPlan]:
    """Schedule once, sample token 7 for every sampling row, finish rows at max_tokens."""
    def run(manager: ResourceManager) -> StepPlan:
        plan = manager.schedule()
        done = []
        for row in plan.scheduled:
            if row.sample:
                row.request.output_token_ids.append(7)
                if len(row.request.output_token_ids) >= row.request.sampling_params.max_tokens:
                    done.append(row.request)
        manager.finish_requests(done, FinishReason.LENGTH)
        for request in done:   # what the engine core does after the manager freed them
            request.status = RequestStatus.FINISHED
        return plan
    return run
