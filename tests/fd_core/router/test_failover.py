"""Backends killed with SIGKILL under a live router: the stream in flight, the next requests, none left.

The module's story, in fixture order: a stream runs through the router and its backend is
killed mid-stream (``killed_mid_stream``); the survivor serves everything after; then the
survivor is killed too. A second router that polls only every 600 s shows that a request
finding a backend unreachable marks it down and goes to the other one, with no poll's help.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.fd_core.router.conftest import API_KEY, KEY, RouterProcess, kill_9, start_router, wait_for
from tests.fd_core.server.conftest import ServerProcess
from tests.fd_core.server.test_requests import metric, metrics, sse_events

PROMPT = [21, 22, 23, 24, 25]
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
#: How long a killed backend may take to show as down in the router's /health: a few polls.
DOWN_WITHIN_S = 5.0


@dataclass
class Pool:
    backends: list[ServerProcess]
    router: RouterProcess       # polls every second (the default)
    slow_router: RouterProcess  # polls every 600 s: it learns of a death from a request only
    expected: str               # greedy text of BODY, answered directly by a backend


@pytest.fixture(scope="module")
def pool(backends: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("failover")
    urls = [b.url for b in backends]
    expected = httpx.post(backends[0].url + "/v1/completions", json=BODY, headers=KEY, timeout=60).json()
    router = start_router(tmp, urls)
    slow_router = start_router(tmp, urls, "--router.health_interval_s", "600", name="slow-router")
    yield Pool(backends, router, slow_router, expected["choices"][0]["text"])
    assert router.stop() == 0, router.log()
    assert slow_router.stop() == 0, slow_router.log()


@dataclass
class Killed:
    victim: ServerProcess
    survivor: ServerProcess
    events: list[str]  # every SSE data field the client got, in order


@pytest.fixture(scope="module")
def killed_mid_stream(pool: Pool) -> Killed:
    """A long stream through the router; its backend is killed after the first events arrived."""
    body = {"prompt": list(range(100, 140)), "max_tokens": 450, "ignore_eos": True, "stream": True}
    # the read timeout bounds the wait: a router that hung on the dead backend fails the test here
    with httpx.stream("POST", pool.router.url + "/v1/completions", json=body, headers=KEY,
                      timeout=httpx.Timeout(30, read=15)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = [next(lines) for _ in range(6)]
        [url] = [e["url"] for e in pool.router.health()["backends"] if e["in_flight"] == 1]
        victim = next(b for b in pool.backends if b.url == url)
        kill_9(victim)
        events = sse_events(first + list(lines))
    survivor = next(b for b in pool.backends if b is not victim)
    return Killed(victim, survivor, events)


def test_a_stream_whose_backend_dies_gets_an_error_event_then_done(killed_mid_stream):
    events = killed_mid_stream.events
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "backend_failed" and killed_mid_stream.victim.url in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    chunks = [json.loads(e) for e in events[:-2]]
    assert 0 < len(chunks) < 450 and all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_the_dead_backend_is_shown_down_and_later_requests_succeed_on_the_other(pool, killed_mid_stream):
    victim, survivor = killed_mid_stream.victim, killed_mid_stream.survivor

    def shown_down() -> bool:
        entry = pool.router.backend(victim.url)
        return entry["status"] == "down" and "cannot connect" in entry["reason"] and entry["load"] is None

    wait_for(shown_down, DOWN_WITHIN_S, "the backend shown down, as it cannot be connected to")
    health = httpx.get(pool.router.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = metrics(pool.router.url)
    assert metric(text, "fd_router_backend_up", f'{{backend="{victim.url}",role="mixed"}}') == 0
    assert metric(text, "fd_router_requests_total", f'{{backend="{victim.url}",outcome="backend_error"}}') == 1

    served = metric(metrics(survivor.url), "fd_request_finished_total", '{finish_reason="length"}')
    client = openai.OpenAI(base_url=pool.router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for _ in range(3):
        answer = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == pool.expected
        stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == pool.expected
    assert metric(metrics(survivor.url), "fd_request_finished_total", '{finish_reason="length"}') == served + 6


def test_a_backend_that_cannot_be_connected_to_is_skipped_for_the_next(pool, killed_mid_stream):
    victim, slow = killed_mid_stream.victim, pool.slow_router
    assert slow.backend(victim.url)["status"] == "ok"  # its one poll was before the kill
    unreachable = f'{{backend="{victim.url}",outcome="unreachable"}}'
    for _ in range(2):  # round-robin between two idle backends: one of the two goes to the victim first
        response = httpx.post(slow.url + "/v1/completions", json=BODY, headers=KEY, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == pool.expected
    assert metric(metrics(slow.url), "fd_router_requests_total", unreachable) == 1
    entry = slow.backend(victim.url)
    assert entry["status"] == "down" and "cannot connect" in entry["reason"]


def test_with_every_backend_down_requests_get_503_no_backend(pool, killed_mid_stream):
    kill_9(killed_mid_stream.survivor)
    router = pool.router
    wait_for(lambda: httpx.get(router.url + "/health", timeout=10).status_code == 503, DOWN_WITHIN_S,
             "the router unavailable")
    body = router.health()
    assert body["status"] == "unavailable" and {e["status"] for e in body["backends"]} == {"down"}
    for stream in (False, True):
        response = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, headers=KEY,
                              timeout=30)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "no_backend"
        for backend in pool.backends:
            assert f"{backend.url} (down: cannot connect" in error["message"]
    with pytest.raises(openai.APIStatusError) as raised:
        openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0).models.list()
    assert raised.value.status_code == 503 and raised.value.code == "no_backend"
    assert metric(metrics(router.url), "fd_router_no_backend_total") == 3
