"""``fd-serve router`` in front of two live tiny-model backends: answers, spreading, pass-through, disconnects.

Every answer through the router is compared with what a backend answers directly (greedy).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.fd_core.router.conftest import API_KEY, KEY, RouterProcess, start_router, wait_for
from tests.fd_core.server.conftest import ServerProcess, free_port
from tests.fd_core.server.test_requests import metric, metrics, read_response, sse_events, wait_all_blocks_free

PROMPT = [11, 12, 13, 14, 15, 16, 17]
MAX_TOKENS = 24
#: Long enough (on the tiny model: about a second) that the client can leave in the middle.
LONG = {"prompt": list(range(100, 140)), "max_tokens": 450, "ignore_eos": True}


@pytest.fixture(scope="module")
def router(backends: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    process = start_router(tmp_path_factory.mktemp("router"), [b.url for b in backends])
    yield process
    assert process.stop() == 0, process.log()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _router_metric(router: RouterProcess, name: str, **labels: str) -> float:
    text = metrics(router.url)
    return metric(text, name, "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")


def _finished(server: ServerProcess, reason: str) -> float:
    return metric(metrics(server.url), "fd_request_finished_total", f'{{finish_reason="{reason}"}}')


def test_health_lists_every_backend_with_its_role_and_load(router, backends):
    response = httpx.get(router.url + "/health", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert [entry["url"] for entry in body["backends"]] == [b.url for b in backends]
    for entry in body["backends"]:
        assert entry["status"] == "ok" and entry["role"] == "mixed" and entry["reason"] is None
        assert set(entry["load"]) >= {"running", "waiting", "in_flight", "free_blocks", "num_blocks"}
        assert entry["in_flight"] == 0
    text = metrics(router.url)
    for backend in backends:
        assert metric(text, "fd_router_backend_up", f'{{backend="{backend.url}",role="mixed"}}') == 1
        assert metric(text, "fd_router_backend_in_flight", f'{{backend="{backend.url}"}}') == 0


def test_the_openai_client_gets_what_a_backend_answers_streaming_or_not(router, backends, tiny_model):
    direct, routed = _client(backends[0].url), _client(router.url)
    model = str(tiny_model)
    args = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = direct.completions.create(prompt=PROMPT, **args).choices[0].text
    assert len(expected) > 0
    for _ in range(2):  # both backends (round-robin when idle) give the greedy answer
        answer = routed.completions.create(prompt=PROMPT, **args)
        assert answer.choices[0].text == expected and answer.usage.completion_tokens == MAX_TOKENS
    chunks = list(routed.completions.create(prompt=PROMPT, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Say something."}]
    expected_chat = direct.chat.completions.create(messages=messages, **args).choices[0].message.content
    assert routed.chat.completions.create(messages=messages, **args).choices[0].message.content == expected_chat
    stream = routed.chat.completions.create(messages=messages, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_chat

    assert routed.models.list().data[0].id == model == direct.models.list().data[0].id


def test_concurrent_requests_are_spread_over_both_backends(router, backends):
    before = [_finished(b, "length") for b in backends]
    ok_before = [_router_metric(router, "fd_router_requests_total", backend=b.url, outcome="ok") for b in backends]
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}

    def one(_: int) -> int:
        return httpx.post(router.url + "/v1/completions", json=body, headers=KEY, timeout=120).status_code

    with ThreadPoolExecutor(8) as workers:
        assert list(workers.map(one, range(8))) == [200] * 8
    served = [_finished(b, "length") - n for b, n in zip(backends, before, strict=True)]
    assert sum(served) == 8 and min(served) >= 2, served
    routed = [_router_metric(router, "fd_router_requests_total", backend=b.url, outcome="ok") - n
              for b, n in zip(backends, ok_before, strict=True)]
    assert routed == served
    assert all(entry["in_flight"] == 0 for entry in router.health()["backends"])


def test_a_backends_400_reaches_the_client_unchanged(router, backends, tiny_model):
    body = {"prompt": PROMPT, "max_tokens": 10**6}
    direct = httpx.post(backends[0].url + "/v1/completions", json=body, headers=KEY, timeout=30)
    routed = httpx.post(router.url + "/v1/completions", json=body, headers=KEY, timeout=30)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json() and routed.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as raised:
        _client(router.url).completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=10**6, stream=True)
    assert raised.value.status_code == 400 and raised.value.param == "max_tokens"


def test_the_authorization_header_is_passed_through(router):
    body = {"prompt": PROMPT, "max_tokens": 2}
    missing = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(router.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    assert httpx.post(router.url + "/v1/completions", json=body, headers=KEY, timeout=30).status_code == 200


def test_a_client_that_leaves_mid_stream_aborts_the_backends_request(router, backends):
    aborted = sum(_finished(b, "abort") for b in backends)
    gone = sum(_router_metric(router, "fd_router_requests_total", backend=b.url, outcome="client_gone")
               for b in backends)
    with httpx.stream("POST", router.url + "/v1/completions", json={**LONG, "stream": True}, headers=KEY,
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):  # a few events in: the backend is generating
            next(lines)
    wait_for(lambda: sum(_finished(b, "abort") for b in backends) == aborted + 1, 10, "the backend aborted")
    wait_for(lambda: all(e["in_flight"] == 0 for e in router.health()["backends"]), 10, "the router let go")
    assert sum(_router_metric(router, "fd_router_requests_total", backend=b.url, outcome="client_gone")
               for b in backends) == gone + 1
    for backend in backends:
        wait_all_blocks_free(backend.url)


def test_a_client_that_leaves_a_non_streaming_request_aborts_the_backends_request(router, backends):
    def ends(reason: str) -> float:
        return sum(_finished(b, reason) for b in backends)

    # LONG takes ~0.45 s on the tiny model and the client leaves at 0.3 s: on a loaded machine the
    # backend can finish it before the router sees the client go. Such a try proves nothing either
    # way, so it is tried again; an abort must come within three tries.
    for _ in range(3):
        aborted, completed = ends("abort"), ends("length")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", content=json.dumps(LONG), headers=KEY,
                       timeout=httpx.Timeout(5, read=0.3))
        wait_for(lambda aborted=aborted, completed=completed: ends("abort") + ends("length") == aborted + completed + 1,
                 10, "the request ended")
        if ends("abort") == aborted + 1:
            break
    assert ends("abort") == aborted + 1, "the backend finished the request each time before the router aborted it"
    wait_for(lambda: all(e["in_flight"] == 0 for e in router.health()["backends"]), 10, "the router let go")


def test_a_stream_is_relayed_event_by_event(router, backends):
    """The first events arrive while the backend is still generating (nothing waits for the end)."""
    with httpx.stream("POST", router.url + "/v1/completions", json={**LONG, "stream": True}, headers=KEY,
                      timeout=30) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(4)]
        running = sum(metric(metrics(b.url), "fd_num_requests_running") for b in backends)
        rest = list(lines)
    assert running == 1  # a backend was still generating when the first events came through
    events = sse_events(first + rest)
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert len(texts) == LONG["max_tokens"] and texts[-1]["finish_reason"] == "length"


def test_unknown_routes_get_the_openai_error_shape(router):
    response = httpx.get(router.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_routers_own_limits_answer_429_and_413_without_a_backend(backends, tmp_path: Path):
    process = start_router(tmp_path, [b.url for b in backends], "--router.max_concurrency", "1",
                           "--router.max_body_bytes", "2000", name="limited")
    try:
        big = httpx.post(process.url + "/v1/completions", json={"prompt": "x" * 3000}, headers=KEY, timeout=10)
        assert big.status_code == 413 and "router.max_body_bytes" in big.json()["error"]["message"]
        with httpx.stream("POST", process.url + "/v1/completions", json={**LONG, "stream": True}, headers=KEY,
                          timeout=30) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # the one slot is taken until the stream ends
            busy = httpx.post(process.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                              headers=KEY, timeout=10)
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            assert "router.max_concurrency" in busy.json()["error"]["message"]
            assert sse_events(list(lines))[-1] == "[DONE]"
        ok = httpx.post(process.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=KEY,
                        timeout=30)
        assert ok.status_code == 200  # the slot came back when the stream ended
    finally:
        assert process.stop() == 0, process.log()


def test_a_client_trickling_its_body_holds_no_slot_and_gets_a_408_naming_the_timeout(backends, tmp_path: Path):
    process = start_router(tmp_path, [b.url for b in backends], "--router.max_concurrency", "1",
                           "--router.body_timeout_s", "3", name="trickled")
    stop = threading.Event()
    try:
        with socket.create_connection(("127.0.0.1", process.port), timeout=30) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n\r\n{")
            trickling = threading.Thread(target=trickle, args=(slow, stop))
            trickling.start()
            stop.wait(1.0)  # the slow client has been sending for a second
            other = httpx.post(process.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                               headers=KEY, timeout=30)
            assert other.status_code == 200, other.text  # the one slot was free: the slow body holds none
            status, headers, body = read_response(slow)
            stop.set()
            trickling.join()
        assert status == 408 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "router.body_timeout_s (3 s)" in error["message"]
    finally:
        stop.set()
        assert process.stop() == 0, process.log()


def trickle(sock: socket.socket, stop: threading.Event) -> None:
    """Send a byte of body every quarter second until ``stop`` (a client on a very slow link)."""
    while not stop.wait(0.25):
        try:
            sock.send(b" ")
        except OSError:
            return


def test_sigterm_stops_the_router_with_exit_0(backends, tmp_path: Path):
    process = start_router(tmp_path, [b.url for b in backends], name="short-lived")
    time.sleep(0.2)
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def test_backend_credentials_are_never_shown(tmp_path: Path):
    """A backend URL's ``user:password@`` stays out of /health, /metrics and client errors."""
    url = f"http://operator:s3cret@127.0.0.1:{free_port()}"   # nothing listens there: down, then 503
    process = start_router(tmp_path, [url], name="credentials")
    try:
        wait_for(lambda: httpx.get(process.url + "/health", timeout=5).json()["backends"][0]["status"] == "down",
                 10, "the backend shown down")
        shown = [httpx.get(process.url + "/health", timeout=5).text,
                 httpx.get(process.url + "/metrics", timeout=5).text,
                 httpx.post(process.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=KEY,
                            timeout=10).text, process.log()]
        assert all("s3cret" not in text and "operator" not in text for text in shown), shown
        assert "http://***@127.0.0.1:" in shown[0]
    finally:
        assert process.stop() == 0, process.log()
