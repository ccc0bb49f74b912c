"""Property tests: both built-in managers pass the conformance kit on random traces and limits."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd_core.contracts.resource_manager import KVLimits
from fd_core.registry import Registry
from fd_core.testing.conformance import check_resource_manager
from fd_plugins.resource_managers.v0 import V0ResourceManager
from fd_plugins.resource_managers.v1.manager import V1ResourceManager

HOOKS = Registry.from_plugins({}).hooks


@st.composite
def limits(draw: Any) -> KVLimits:
    """Small pools and budgets, so that preemption, eviction and waiting all happen."""
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 24))
    max_num_seqs = draw(st.integers(1, 6))
    return KVLimits(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 40)),
        max_model_len=draw(st.integers(2, 64)),
        enable_chunked_prefill=draw(st.booleans()), enable_prefix_caching=draw(st.booleans()))


TRACE = dict(seed=st.integers(0, 2**32 - 1), num_requests=st.integers(1, 30), abort_prob=st.sampled_from([0.0, 0.05]))
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(limits=limits(), **TRACE)
def test_v1_conforms(limits: KVLimits, seed: int, num_requests: int, abort_prob: float) -> None:
    report = check_resource_manager(lambda lim: V1ResourceManager(None, limits=lim, hooks=HOOKS), seed=seed,
                                    limits=limits, num_requests=num_requests, abort_prob=abort_prob)
    if not limits.enable_prefix_caching:
        assert report.prefix_cache_hits == 0


@PROPERTY
@given(limits=limits(), **TRACE)
def test_v0_conforms_and_never_preempts(limits: KVLimits, seed: int, num_requests: int, abort_prob: float) -> None:
    report = check_resource_manager(lambda lim: V0ResourceManager(None, limits=lim, hooks=HOOKS), seed=seed,
                                    limits=limits, num_requests=num_requests, abort_prob=abort_prob,
                                    allow_lone_oversized_prompt=True)
    assert report.num_preemptions == 0


def test_v1_preempts_and_hits_on_the_default_tiny_pool() -> None:
    report = check_resource_manager(lambda lim: V1ResourceManager(None, limits=lim, hooks=HOOKS),
                                    seed=7, num_requests=60)
    assert report.num_preemptions > 0 and report.prefix_cache_hits > 0
    again = check_resource_manager(lambda lim: V1ResourceManager(None, limits=lim, hooks=HOOKS),
                                   seed=7, num_requests=60)
    assert again == report   # deterministic for a seed
