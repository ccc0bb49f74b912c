"""The selection rule (fd_core.router.choose) over backends in known states."""

from __future__ import annotations

import httpx
import pytest

from fd_core.router.backends import Backend, BackendPool
from fd_core.router.choose import choose, score, why_out
from fd_core.router.config import RouterSection


def _backend(i: int, *, status: str = "ok", role: str = "mixed", running: int = 0, waiting: int = 0,
             in_flight: int = 0) -> Backend:
    backend = Backend(f"http://10.0.0.{i}:8000", status=status, role=role,
                      load={"running": running, "waiting": waiting, "in_flight": 0, "free_blocks": 1, "num_blocks": 1})
    backend.in_flight = in_flight
    return backend


def test_the_least_loaded_wins_counting_the_routers_own_requests():
    busy, idle = _backend(0, running=2, waiting=1), _backend(1, running=1)
    assert score(busy) == 3 and score(idle) == 1
    assert choose([busy, idle]) is idle
    idle.in_flight = 3  # sent since the last poll: the router's own count is live
    assert score(idle) == 4 and choose([busy, idle]) is busy
    unpolled = Backend("http://10.0.0.9:8000", status="ok", role="mixed")
    unpolled.in_flight = 2
    assert score(unpolled) == 2  # no reported load: only what the router sent


def test_prefill_instances_and_unhealthy_ones_never_take_requests():
    prefill = _backend(0, role="prefill")
    decode = _backend(1, role="decode", running=50)
    assert choose([prefill, decode]) is decode
    assert why_out(prefill) == "role prefill: the router sends requests only to mixed and decode instances"
    for status in ("starting", "draining", "dead", "down", "unknown"):
        backend = _backend(2, status=status)
        backend.reason = "because"
        assert choose([backend]) is None and why_out(backend) == f"{status}: because"
    degraded = _backend(3, status="degraded", running=9)
    assert choose([degraded, _backend(4, status="dead")]) is degraded  # degraded still serves


def test_tried_backends_are_skipped():
    a, b = _backend(0), _backend(1, running=5)
    assert choose([a, b], exclude={a}) is b
    assert choose([a, b], exclude={a, b}) is None


@pytest.mark.parametrize("after", [0, 1, 2, 3, 5])
def test_ties_start_at_the_round_robin_position(after):
    backends = [_backend(i) for i in range(3)]
    assert choose(backends, after=after) is backends[after % 3]


def test_the_pool_goes_round_robin_among_equally_loaded_backends():
    settings = RouterSection(backends=[f"http://10.0.0.{i}:8000" for i in range(3)])
    pool = BackendPool(settings, httpx.AsyncClient())
    for backend in pool.backends:
        backend.status, backend.role, backend.load = "ok", "mixed", {"running": 0, "waiting": 0}
    pool.backends[1].role = "prefill"
    picked = [pool.choose(exclude=set()) for _ in range(4)]
    assert [pool.backends.index(b) for b in picked] == [0, 2, 0, 2]
    pool.backends[2].load = {"running": 1, "waiting": 0}
    assert [pool.backends.index(pool.choose(exclude=set())) for _ in range(2)] == [0, 0]
