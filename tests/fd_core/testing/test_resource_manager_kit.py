"""The resource manager kit's report rows (what fd-serve plugins check prints): built-ins pass, a leak is named."""

from __future__ import annotations

import pytest

from fd_core.registry import Registry
from fd_core.testing.conformance import (
    ConformanceError,
    check_resource_manager,
    run_plugin_checks,
)
from fd_plugins.resource_managers.v0 import V0ResourceManager
from fd_plugins.resource_managers.v1.manager import V1ResourceManager

HOOKS = Registry.from_plugins({}).hooks


@pytest.mark.parametrize("cls", [V0ResourceManager, V1ResourceManager])
def test_the_built_ins_pass_every_row(cls):
    report = run_plugin_checks("resource_manager", cls, {})
    assert [(r.check, r.status) for r in report.results] == [
        ("tiny_pool", "passed"), ("no_prefix_caching", "passed"), ("strict_budget", "passed"),
        ("prompt_logprobs", "passed")]


def test_a_manager_that_leaks_a_block_is_caught_naming_the_invariant(broken_plugins):
    leaks = broken_plugins.resource_manager.LeaksBlocks
    report = run_plugin_checks("resource_manager", leaks, {})
    assert not report.ok and {r.invariant for r in report.failures} == {"no block leaks or double frees"}
    with pytest.raises(ConformanceError, match=r"^resource manager invariant 'no block leaks or double frees' "
                                               r"broken: LeaksBlocks \(seed 0, step \d+\): num_free_blocks\(\)"):
        check_resource_manager(lambda limits: leaks(None, limits=limits, hooks=HOOKS))


def test_a_manager_that_serves_prompt_logprobs_from_its_prefix_cache_is_caught():
    class HitsForEveryone(V1ResourceManager):
        def _looks_up(self, request):
            return self.prefix_cache is not None

    with pytest.raises(ConformanceError, match="'a request that needs prompt logprobs computes its whole prompt' "
                                               r"broken: HitsForEveryone.*needs prompt logprobs"):
        check_resource_manager(lambda limits: HitsForEveryone(None, limits=limits, hooks=HOOKS),
                               prompt_logprobs_every=3)
    report = run_plugin_checks("resource_manager", HitsForEveryone, {})
    assert [r.check for r in report.failures] == ["prompt_logprobs"]


def test_options_reach_the_manager():
    report = run_plugin_checks("resource_manager", V0ResourceManager, {"reserved_decode_blocks": 0})
    assert report.ok
