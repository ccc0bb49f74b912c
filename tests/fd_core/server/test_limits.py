"""Bounded input: the body limit (413), a large body prepared off the event loop, and the limits
on stop strings and n x max_tokens, in fd-serve and in the engine itself."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from fd_core.errors import RequestError
from fd_core.request import MAX_CHOICE_TOKENS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from fd_core.server.body import count_values
from tests.fd_core.server.conftest import TINY_ARGS, start_server
from tests.fd_core.server.test_requests import assert_error, assert_still_serving, post

#: server.max_body_bytes of the server under test.
LIMIT = 2**20
TEXT = "The quick brown fox jumps over the lazy dog. " * 200


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("limits"), "--model.source", str(tiny_model), *TINY_ARGS,
                          "--server.max_body_bytes", str(LIMIT))
    yield server
    assert server.stop() == 0, server.log()


def oversized_body() -> bytes:
    return json.dumps({"prompt": "hello " * (LIMIT // 2), "max_tokens": 1}).encode()


def test_a_declared_body_over_the_limit_is_413_naming_it(server):
    response = httpx.post(server.url + "/v1/completions", content=oversized_body(), timeout=60)
    assert_error(response, 413, "Content-Length", "server.max_body_bytes", str(LIMIT))
    assert_still_serving(server.url)


def test_a_chunked_body_is_refused_once_it_passes_the_limit_and_health_answers_meanwhile(server):
    body = oversized_body()
    health: list[int] = []

    def chunks() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        for start in range(0, len(body), 64 * 1024):
            if start == 2 * LIMIT:  # the server refuses after LIMIT bytes; it must answer others meanwhile
                health.append(httpx.get(server.url + "/health", timeout=60).status_code)
            yield body[start:start + 64 * 1024]

    response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    assert_error(response, 413, "more than", "server.max_body_bytes", str(LIMIT))
    assert health == [200]
    assert_still_serving(server.url)


def test_the_openai_client_gets_413(server, tiny_model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=str(tiny_model), prompt="hello " * LIMIT, max_tokens=1)
    assert info.value.status_code == 413 and "server.max_body_bytes" in info.value.message


def test_health_sent_while_a_maximal_body_is_prepared_is_answered_first(server):
    # 128 prompts of 8000 characters: each is short enough to be tokenised (and then found too
    # long for max_model_len 512), and together they keep the server busy for a while. Were they
    # parsed and tokenised on the event loop, /health would wait for the whole request.
    body = json.dumps({"prompt": [TEXT[:8000]] * 128, "max_tokens": 1}).encode()
    assert LIMIT - 64 * 1024 < len(body) <= LIMIT
    uploaded = threading.Event()
    finished: list[str] = []

    def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            uploaded.set()

    def big() -> httpx.Response:
        with httpx.Client(timeout=120) as client:
            response = client.post(server.url + "/v1/completions", content=body, extensions={"trace": trace})
        finished.append("big request")
        return response

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(big)
        assert uploaded.wait(60) or future.result()
        health = httpx.get(server.url + "/health", timeout=120)
        finished.append("health")
        response = future.result(timeout=120)
    assert health.status_code == 200
    assert_error(response, 400, "tokens", "max_model_len is 512", param="prompt[0]")
    assert finished == ["health", "big request"]


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE).group(1)) * 1024


def test_millions_of_token_ids_are_refused_unparsed_while_health_answers_and_memory_stays(tiny_server):
    # 3.9 M ids in 7.8 MB, under the default server.max_body_bytes: parsed whole, they held the GIL
    # for seconds and left the front end hundreds of MiB larger for good
    body = json.dumps({"prompt": [7] * 3_900_000, "max_tokens": 1}, separators=(",", ":")).encode()
    assert len(body) < 8 * 2**20
    before = rss_bytes(tiny_server.proc.pid)
    health_s: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(lambda: [post(tiny_server.url, "/v1/completions", body) for _ in range(4)])
        while not posted.done():
            start = time.monotonic()
            assert httpx.get(tiny_server.url + "/health", timeout=60).status_code == 200
            health_s.append(time.monotonic() - start)
        responses = posted.result()
    grown = rss_bytes(tiny_server.proc.pid) - before
    assert max(health_s) < 2.0, health_s  # parsing one such body took 3-5 s with the GIL held
    assert grown < 100 * 2**20, f"the front end grew by {grown >> 20} MiB"
    for response in responses:
        assert_error(response, 413, "more than 132608 JSON values", "counted 3900001", "max_model_len (512)")


@pytest.mark.parametrize(("path", "extra", "words", "param"), [
    ("/v1/completions", {"stop": ["a"] * (MAX_STOP_STRINGS + 1)},
     [f"at most {MAX_STOP_STRINGS} stop strings", f"got {MAX_STOP_STRINGS + 1}"], "stop"),
    ("/v1/completions", {"stop": "z" * (MAX_STOP_STRING_CHARS + 1)},
     [f"at most {MAX_STOP_STRING_CHARS} characters", f"{MAX_STOP_STRING_CHARS + 1}"], "stop"),
    ("/v1/completions", {"n": 128, "max_tokens": 4000},
     [f"n x max_tokens must be at most {MAX_CHOICE_TOKENS}", "128 x 4000 = 512000"], "max_tokens"),
    ("/v1/chat/completions", {"n": 100, "max_completion_tokens": 3000},
     [f"at most {MAX_CHOICE_TOKENS}", "100 x 3000"], "max_completion_tokens"),
])
def test_stop_strings_and_n_x_max_tokens_are_limited(server, path, extra, words, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(server.url + path, json={**base, **extra}, timeout=60)
    assert_error(response, 400, *words, param=param)


def test_the_most_stop_strings_allowed_still_work(server):
    stop = ["zz" + "q" * i for i in range(MAX_STOP_STRINGS - 1)] + ["y" * MAX_STOP_STRING_CHARS]
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stop": stop,
                                                                 "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def llm(tiny_model):
    from fd_core.engine.llm import LLM

    return LLM(str(tiny_model), cache={"num_blocks": 16})


@pytest.mark.parametrize(("params", "field", "words"), [
    (SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
    (SamplingParams(stop=["a" * (MAX_STOP_STRING_CHARS + 1)]), "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
    (SamplingParams(n=64, max_tokens=MAX_CHOICE_TOKENS // 64 + 1), "max_tokens",
     f"n x max_tokens must be at most {MAX_CHOICE_TOKENS}"),
])
def test_the_offline_llm_refuses_the_same_requests(llm, params, field, words):
    with pytest.raises(RequestError) as info:
        llm.generate([[5, 6, 7]], params)
    assert info.value.field == field and words in str(info.value)
    assert llm.engine.scheduler.num_waiting() == 0


@pytest.mark.parametrize(("body", "count"), [
    (b'{"prompt": [1, 2, 3], "max_tokens": 4}', 4),
    (b'{"prompt": "a, b, \\"c, d\\", e\\\\", "stop": [",", "\\\\,"]}', 3),   # commas and escapes in strings
    (b'{"messages": [{"role": "user", "content": "x,y"}]}', 2),
])
def test_values_are_counted_by_the_commas_outside_strings(body, count):
    assert count_values(body) == count
