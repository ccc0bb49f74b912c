"""The randomised fault schedule (:mod:`tests.fd_core.server.fault_schedule`) on a few seeds per
deployment shape: kill -9, SIGSTOP past a lease, Redis paused and restarted, a connector link cut,
against real fd-serve instances on one real redis-server. A failure prints the seed and its plan;
more seeds run with ``python -m tests.fd_core.server.fault_schedule --shape SHAPE --seeds 0:50``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fd_core.server.fault_schedule import LEASE_S, POOL, SPLITWISE, Shape, draw_plan, reference_texts, run_seed

#: Seeds CI runs per shape: between them, their plans draw every kind of fault of the shape and a
#: pause past a lease (the pool's also a kill with and without a restart, and a pause of ``a``, whose
#: queue peers take from).
CI_SEEDS = {POOL: (8, 9), SPLITWISE: (0, 11)}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[tuple[int, int | str], str]:
    return reference_texts(tiny_model)


@pytest.mark.parametrize("shape", CI_SEEDS, ids=lambda shape: shape.name)
def test_the_ci_seeds_draw_every_kind_of_fault(shape: Shape) -> None:
    faults = [f for seed in CI_SEEDS[shape] for f in draw_plan(shape, seed).faults]
    assert {f.kind for f in faults} == set(shape.kinds)
    assert any(f.kind == "pause" and f.hold_s > LEASE_S for f in faults)


@pytest.mark.parametrize(("shape", "seed"), [(shape, seed) for shape, seeds in CI_SEEDS.items() for seed in seeds],
                         ids=lambda value: value.name if isinstance(value, Shape) else str(value))
def test_every_request_ends_exactly_and_nothing_leaks_under_a_drawn_fault_schedule(shape, seed, tmp_path, tiny_model,
                                                                                     reference, redis_server):
    result = run_seed(shape, seed, tmp_path, tiny_model, reference)
    assert not result.violations, (f"fault schedule failed; replay with --shape {shape.name} --seeds {seed}:{seed + 1}"
                                   f"\n{result.report()}")
