"""``parallel.data_parallel_size = 2``: two engine processes behind one fd-serve."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fd_core.request import SamplingParams
from fd_core.server.data_parallel import split_cpus
from tests.fd_core.server.conftest import TINY_ARGS, start_server
from tests.fd_core.server.test_lifecycle import read_stream
from tests.fd_core.server.test_pool import PROMPTS, _wait_for
from tests.fd_core.server.test_requests import metric, metrics

MAX_TOKENS = 24


def _complete(url: str, index: int) -> httpx.Response:
    body = {"prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


#: Output length of the two requests running when a rank is killed.
LONG_MAX_TOKENS = 300


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, list[str]]:
    """Greedy texts from one offline engine: ``short`` of every prompt, ``long`` of the first two."""
    from fd_core.engine.llm import LLM

    llm = LLM(str(tiny_model), cache={"num_blocks": 256})
    short = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {"short": [r.text for r in llm.generate(PROMPTS, short)],
            "long": [r.text for r in llm.generate(PROMPTS[:2], long)]}


def test_cpus_are_shared_out_without_overlap() -> None:
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([5], 3) == [[5], [5], [5]]


def test_two_ranks_answer_like_one_share_the_work_and_free_every_block(tiny_model, tmp_path, reference) -> None:
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS,
                          "--parallel.data_parallel_size", "2")
    try:
        assert len(server.engine_pids()) == 2
        affinities = [os.sched_getaffinity(pid) for pid in server.engine_pids()]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not affinities[0] & affinities[1], affinities
        with ThreadPoolExecutor(8) as workers:
            texts = [r.json()["choices"][0]["text"] for r in workers.map(lambda i: _complete(server.url, i), range(8))]
        assert texts == reference["short"]
        text = metrics(server.url)
        for rank in ("0", "1"):
            assert metric(text, "fd_dp_rank_generation_tokens_total", f'{{rank="{rank}"}}') > 0, text
            assert metric(text, "fd_dp_rank_up", f'{{rank="{rank}"}}') == 1
        _wait_for(lambda: all(
            metric(t := metrics(server.url), "fd_dp_rank_kv_cache_blocks_free", f'{{rank="{r}"}}')
            == metric(t, "fd_dp_rank_kv_cache_blocks_total", f'{{rank="{r}"}}') > 0 for r in "01"),
            "every KV block free on both ranks")

        # one long stream per rank (the second call goes to the rank with fewer tokens in flight);
        # killing rank 1 mid-stream continues its request on rank 0 from the tokens already sent
        starts = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as workers:
            streams = [workers.submit(read_stream, server.url, {"prompt": PROMPTS[i], "max_tokens": LONG_MAX_TOKENS,
                                                                "temperature": 0, "ignore_eos": True}, starts[i])
                       for i in range(2)]
            assert all(start.wait(30) for start in starts)
            os.kill(server.engine_pids()[1], signal.SIGKILL)
            events = [future.result(timeout=60) for future in streams]
        assert not [e for stream in events for e in stream if '"error"' in e]
        texts = ["".join(json.loads(e)["choices"][0]["text"] for e in stream[:-1]) for stream in events]
        assert texts == reference["long"], "a stream continued on rank 0 differs from one uninterrupted run"
        assert metric(metrics(server.url), "fd_dp_requests_continued_total") == 1
        health = _wait_for(lambda: (h := httpx.get(server.url + "/health")).json()["status"] == "degraded" and h,
                           "/health to say degraded")
        assert health.status_code == 200
        assert "data-parallel rank 1" in health.json()["reason"] and "SIGKILL" in health.json()["reason"]
        with ThreadPoolExecutor(4) as workers:
            answers = list(workers.map(lambda i: _complete(server.url, i), range(4)))
        assert [a.json()["choices"][0]["text"] for a in answers] == reference["short"][:4]
        assert metric(metrics(server.url), "fd_dp_rank_up", '{rank="1"}') == 0
        assert server.proc.poll() is None, "fd-serve exited though rank 0 still serves"
    finally:
        assert server.stop() == 0, server.log()


def test_the_offline_engine_refuses_data_parallel_naming_the_key(tiny_model) -> None:
    from fd_core.engine.llm import LLM
    from fd_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_size: 2: an in-process engine is one rank"):
        LLM(str(tiny_model), parallel={"data_parallel_size": 2})


def test_traced_hook_figures_of_the_ranks_are_summed_by_hook_and_plugin() -> None:
    from fd_core.server.data_parallel import _sum_stats

    rank = lambda calls, seconds: {"hooks": [{"hook": "fd_order_waiting", "plugin": "p", "calls": calls,  # noqa: E731
                                              "errors": 0, "seconds": seconds}], "num_steps": calls}
    merged = _sum_stats([rank(2, 0.5), rank(3, 0.25)])
    assert merged["hooks"] == [{"hook": "fd_order_waiting", "plugin": "p", "calls": 5, "errors": 0, "seconds": 0.75}]
    assert merged["num_steps"] == 5
