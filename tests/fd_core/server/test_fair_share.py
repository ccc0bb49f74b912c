"""A large-n request does not starve a small one on a real fd-serve (issue 41 item 20)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fd_core.server.conftest import start_server
from tests.fd_core.server.test_requests import wait_all_blocks_free

BIG_N = 16            # four times the slots: without fair sharing the small request waits a quarter of it
BIG_TOKENS = 200


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("fair"), "--model.source", str(tiny_model),
                          "--model.max_model_len", "512", "--cache.num_blocks", "128",
                          "--engine.max_num_seqs", "4", "--engine.max_num_batched_tokens", "64",
                          "--platform.options", '{"kernels": "portable"}')   # no C++ kernel build to wait for
    yield server
    assert server.stop() == 0, server.log()


def stream_big(url: str, running: threading.Event) -> tuple[dict[int, str], int, float]:
    """Stream the large-n completion; ``running`` at its first chunk. Returns each choice's finish
    reason, the completion tokens of all choices, and the time (monotonic) it finished."""
    body = {"prompt": list(range(100, 120)), "n": BIG_N, "max_tokens": BIG_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    reasons: dict[int, str] = {}
    usage = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                reasons.update((c["index"], c["finish_reason"]) for c in chunk["choices"] if c["finish_reason"])
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
                running.set()
    return reasons, usage, time.monotonic()


def test_a_small_request_completes_long_before_a_large_n_request_that_holds_every_slot(server):
    running = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(stream_big, server.url, running)
        assert running.wait(60)
        sent = time.monotonic()
        small = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"prompt": [7, 8, 9, 10], "max_tokens": 4, "ignore_eos": True})
        small_done = time.monotonic()
        big_reasons, big_tokens, big_done = big.result(timeout=300)
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 4
    assert big_reasons == dict.fromkeys(range(BIG_N), "length") and big_tokens == BIG_N * BIG_TOKENS
    # without fair sharing the small request waits for the first four choices to finish: about a
    # quarter of the big request's time; with it, a few steps
    assert small_done - sent < (big_done - sent) / 10, (small_done - sent, big_done - sent)
    wait_all_blocks_free(server.url)
