"""Prefill and decode fd-serve instances (real processes, a real Redis directory, each connector):
answers equal one mixed engine's (constrained ones too: the prefill instance applies the mask to
the first token it samples), every block is free on both sides afterwards, and a dead instance
never leaves a client hanging or blocks held."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from fd_core.request import SamplingParams
from fd_core.testing.redis_server import RedisServer, redis_server_path
from tests.fd_core.router.conftest import RouterProcess
from tests.fd_core.server import constrained
from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, start_server
from tests.fd_core.server.test_pool import PROMPTS, _wait_for
from tests.fd_core.server.test_requests import metric, metrics

MAX_TOKENS = 24
#: Prompts (indexes) of the constrained requests sent through a pair.
CONSTRAINED = range(4)
#: Short hand-off timers, so that a dead peer is given up within a few seconds.
TIMERS = ("--splitwise.heartbeat_s", "0.2", "--splitwise.stall_timeout_s", "2.0")


@pytest.fixture(scope="module")
def redis(tmp_path_factory) -> Iterator[RedisServer]:
    if redis_server_path() is None:
        if os.environ.get("FD_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed but FD_REQUIRE_REDIS is set (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def start_role(tmp_path: Path, tiny_model: Path, redis: RedisServer, role: str, connector: str, *args: str,
               topic: str = "t", name: str | None = None, lease_s: float = 1.0) -> ServerProcess:
    return start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS, *TIMERS,
                        "--splitwise.role", role, "--scheduler.name", "splitwise",
                        "--scheduler.options", f'{{"url": "{redis.url}", "topic": "{topic}", "heartbeat_s": 0.2, '
                                               f'"lease_s": {lease_s}}}',
                        "--connector.name", connector, *args, name=name or role)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, list[str]]:
    """Greedy texts of one mixed offline engine: ``free`` of every prompt, ``json`` (constrained,
    :mod:`tests.fd_core.server.constrained`) of those in CONSTRAINED."""
    from fd_core.engine.llm import LLM

    llm = LLM(str(tiny_model), cache={"num_blocks": 256})
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return {"free": [r.text for r in free], "json": constrained.references(llm, [PROMPTS[i] for i in CONSTRAINED])}


def wait_blocks_free(*servers: ServerProcess, timeout: float = 15.0) -> None:
    for server in servers:
        _wait_for(lambda s=server: metric(t := metrics(s.url), "fd_kv_cache_blocks_free")
                  == metric(t, "fd_kv_cache_blocks_total") > 0, f"every KV block free on {server.url}", timeout)


@pytest.mark.parametrize("connector, speculate", [("zmq", False), ("shm", True)])
def test_a_prefill_decode_pair_answers_like_one_mixed_engine(tiny_model, redis, tmp_path, reference, connector,
                                                             speculate):
    """With ``speculate``, the decode instance verifies guesses of a draft (the model itself) from the
    first token on, which the prefill instance sampled."""
    prefill = start_role(tmp_path, tiny_model, redis, "prefill", connector, topic=connector)
    draft = ("--proposer.name", "draft", "--proposer.options", json.dumps({"model": str(tiny_model)}))
    decode = start_role(tmp_path, tiny_model, redis, "decode", connector, *(draft if speculate else ()),
                        topic=connector)
    router = RouterProcess([prefill.url, decode.url], tmp_path / "router.log")
    try:
        router.wait_answering()
        _wait_for(lambda: router.health()["status"] == "ok", "the router sees the decode instance")
        assert {b["url"]: b["role"] for b in router.health()["backends"]} == {prefill.url: "prefill",
                                                                                decode.url: "decode"}
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(i: int) -> str:
            return client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        def stream(i: int) -> str:
            chunks = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)

        def guided(i: int) -> str:   # constrained; streamed for odd i
            fields = constrained.body(PROMPTS[i])
            reply = client.completions.create(model=model, prompt=fields.pop("prompt"), stream=bool(i % 2),
                                              extra_body=fields)
            return "".join(c.choices[0].text for c in reply if c.choices) if i % 2 else reply.choices[0].text

        with ThreadPoolExecutor(8) as workers:
            texts = list(workers.map(complete, range(len(PROMPTS))))
            streamed = list(workers.map(stream, range(len(PROMPTS))))
            replies = list(workers.map(guided, CONSTRAINED))
        assert texts == reference["free"] and streamed == reference["free"]
        # the first token (sampled on the prefill instance) is "{", not the greedy favourite
        for reply, expected in zip(replies, reference["json"], strict=True):
            constrained.check(reply, expected)
        # prompt logprobs come from the prefill instance with the first token
        scored = client.completions.create(model=model, prompt=[5, 17, 42, 99, 7], max_tokens=2, temperature=0,
                                           echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0]
        values = scored.logprobs.token_logprobs
        assert len(values) == 5 + 2 and values[0] is None and all(v <= 0 for v in values[1:])
        wait_blocks_free(prefill, decode)
        on_decode, on_prefill = metrics(decode.url), metrics(prefill.url)
        handed_off = 2 * len(PROMPTS) + len(CONSTRAINED) + 1
        assert metric(on_decode, "fd_splitwise_transfers_done_total") == handed_off
        assert metric(on_prefill, "fd_splitwise_jobs_done_total") == handed_off
        assert metric(on_prefill, "fd_splitwise_connector_bytes_sent_total") > 0
        assert metric(on_decode, "fd_prompt_tokens_total") == 0   # no prompt computed on the decode side
        assert (metric(on_decode, "fd_spec_accepted_tokens_total") > 0) == speculate
        # every request went to the decode instance (a stream is counted once it ended), none to the prefill one
        _wait_for(lambda: metric(metrics(router.url), "fd_router_requests_total",
                                 f'{{backend="{decode.url}",outcome="ok"}}') >= handed_off, "the router's count")
        on_router = metrics(router.url)
        assert metric(on_router, "fd_router_requests_total", f'{{backend="{prefill.url}",outcome="ok"}}') == 0
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def _kill(server: ServerProcess) -> None:
    """kill -9 the engine processes and the front end."""
    for pid in server.engine_pids():
        os.kill(pid, signal.SIGKILL)
    server.proc.kill()
    server.proc.wait()


def _stream_or_error(url: str, body: dict, started: threading.Event) -> tuple[int, list[str]]:
    """A streaming completion's status and SSE payloads (or, if it was refused, its body)."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        if response.status_code != 200:
            started.set()
            return response.status_code, [response.read().decode()]
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()
    return 200, events


def test_a_killed_decode_instance_fails_its_clients_and_frees_the_prefill_side(tiny_model, redis, tmp_path):
    prefill = start_role(tmp_path, tiny_model, redis, "prefill", "zmq", topic="kill-d")
    decode = start_role(tmp_path, tiny_model, redis, "decode", "zmq", topic="kill-d")
    router = RouterProcess([decode.url], tmp_path / "router.log")
    try:
        router.wait_answering()
        _wait_for(lambda: router.health()["status"] == "ok", "the router sees the decode instance")
        body = {"prompt": list(range(20, 260)), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        starts = [threading.Event() for _ in range(6)]
        with ThreadPoolExecutor(6) as workers:
            futures = [workers.submit(_stream_or_error, router.url, body, started) for started in starts]
            assert starts[0].wait(60)
            killed_at = time.monotonic()
            _kill(decode)
            answers = [future.result(timeout=30) for future in futures]
            assert time.monotonic() - killed_at < 30   # every client hears of it promptly
        for status, events in answers:
            if status == 200:   # streaming already: an error event naming the backend, then [DONE]
                assert events[-1] == "[DONE]" and '"error"' in events[-2] and decode.url in events[-2], events[-3:]
            elif status == 502:  # it had the request but died before the stream began
                assert decode.url in events[0], events
            else:               # it reached the router only after the kill: 503 no_backend, naming it as down
                assert status == 503 and '"no_backend"' in events[0] and decode.url in events[0], (status, events)
        wait_blocks_free(prefill, timeout=20)   # stall_timeout_s (2 s) after the decode side went silent
        assert metric(metrics(prefill.url), "fd_splitwise_jobs_open") == 0
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_a_killed_prefill_instance_is_replaced_by_another(tiny_model, redis, tmp_path, reference):
    # a long directory lease: the killed instance stays listed (and is asked) for ~3 s after its death
    first = start_role(tmp_path, tiny_model, redis, "prefill", "zmq", topic="kill-p", lease_s=3.0, name="prefill-1")
    second = start_role(tmp_path, tiny_model, redis, "prefill", "zmq", topic="kill-p", lease_s=3.0, name="prefill-2")
    decode = start_role(tmp_path, tiny_model, redis, "decode", "zmq", topic="kill-p")
    try:
        client = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        _kill(first)
        with ThreadPoolExecutor(4) as workers:   # placed by load: half go to the dead instance first
            texts = list(workers.map(lambda i: client.completions.create(
                model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text, range(4)))
        assert texts == reference["free"][:4]
        text = metrics(decode.url)
        assert metric(text, "fd_splitwise_transfers_stalled_total") >= 1
        wait_blocks_free(decode, second)
    finally:
        for server in (decode, first, second):
            server.stop()
