"""``parallel.data_parallel_size = 2``: two engine processes behind one fd-serve."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fd_core.config import load_config
from fd_core.errors import EngineDeadError
from fd_core.host_topology import read_host_topology
from fd_core.model.loader import load_model
from fd_core.outputs import RequestOutput
from fd_core.request import FinishReason, Request, SamplingParams
from fd_core.runner.kv_cache import kv_cache_bytes_per_block
from fd_core.server import wire
from fd_core.server.data_parallel import DataParallelClient
from fd_core.server.metrics import MEMORY_PARTS
from fd_core.server.rank_placement import cpu_shares, describe_shares
from tests.fd_core.server import constrained
from tests.fd_core.server.conftest import START_TIMEOUT_S, TINY_ARGS, start_server
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
    """Greedy texts from one offline engine: ``short`` of every prompt, ``long`` and ``json``
    (constrained, :mod:`tests.fd_core.server.constrained`) of the first two."""
    from fd_core.engine.llm import LLM

    llm = LLM(str(tiny_model), cache={"num_blocks": 256})
    short = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {"short": [r.text for r in llm.generate(PROMPTS, short)],
            "long": [r.text for r in llm.generate(PROMPTS[:2], long)],
            "json": constrained.references(llm, PROMPTS[:2])}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_two_ranks_answer_like_one_share_the_work_and_free_every_block(tiny_model, tmp_path, reference) -> None:
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS,
                          "--parallel.data_parallel_size", "2")
    try:
        assert len(server.engine_pids()) == 2
        topology = read_host_topology()
        assert describe_shares(topology, cpu_shares(topology, 2)) in server.log(), "no share or domain logged"
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
        arch = load_model(str(tiny_model)).arch   # the resident memory is summed over the ranks: two pools
        pool = int(TINY_ARGS[TINY_ARGS.index("--cache.num_blocks") + 1]) * kv_cache_bytes_per_block(
            arch, load_config().cache.block_size)
        kv_cache = metric(text, "fd_memory_bytes", '{part="kv_cache"}')
        assert 2 * pool <= kv_cache <= 2 * pool + 8 * arch.num_hidden_layers * mmap.PAGESIZE, text
        assert metric(text, "fd_memory_resident_bytes") == sum(
            metric(text, "fd_memory_bytes", f'{{part="{part}"}}') for part in MEMORY_PARTS)
        cpu_before = sum(_cpu_seconds(pid) for pid in server.engine_pids())
        text = metrics(server.url)   # the engines' CPU time, summed over the ranks, as /proc counts it
        cpu_after = sum(_cpu_seconds(pid) for pid in server.engine_pids())
        assert cpu_before - 0.05 <= metric(text, "fd_engine_cpu_seconds_total") <= cpu_after + 0.05, text
        assert 0 < metric(text, "fd_engine_runner_seconds_total") < metric(text, "fd_engine_busy_seconds_total")
        assert metric(text, "process_cpu_seconds_total") > 0   # the front end's own
        _wait_for(lambda: all(
            metric(t := metrics(server.url), "fd_dp_rank_kv_cache_blocks_free", f'{{rank="{r}"}}')
            == metric(t, "fd_dp_rank_kv_cache_blocks_total", f'{{rank="{r}"}}') > 0 for r in "01"),
            "every KV block free on both ranks")

        # one long stream per rank (the second call goes to the rank with fewer tokens in flight),
        # then one constrained stream per rank (by the same rule); killing rank 1 once all four run
        # continues its two requests on rank 0 from the tokens already sent, the constrained one mid-JSON
        bodies = [{"prompt": PROMPTS[i], "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                  for i in range(2)] + [constrained.body(PROMPTS[i]) for i in range(2)]
        starts = [threading.Event() for _ in bodies]
        with ThreadPoolExecutor(len(bodies)) as workers:
            streams = []
            for pair in (range(2), range(2, 4)):
                streams += [workers.submit(read_stream, server.url, bodies[i], starts[i]) for i in pair]
                assert all(starts[i].wait(30) for i in pair)
            os.kill(server.engine_pids()[1], signal.SIGKILL)
            events = [future.result(timeout=60) for future in streams]
        assert not [e for stream in events for e in stream if '"error"' in e]
        texts = ["".join(json.loads(e)["choices"][0]["text"] for e in stream[:-1]) for stream in events]
        assert texts[:2] == reference["long"], "a stream continued on rank 0 differs from one uninterrupted run"
        for text, expected in zip(texts[2:], reference["json"], strict=True):
            constrained.check(text, expected)
        text = metrics(server.url)
        assert metric(text, "fd_dp_requests_continued_total") == 2, "rank 1 did not die with two requests running"
        # each request finished once (no late final of the dead rank counted), nothing left placed
        assert metric(text, "fd_request_finished_total", '{finish_reason="length"}') == 8 + 2
        assert metric(text, "fd_request_finished_total", '{finish_reason="stop"}') == 2
        assert [metric(text, "fd_dp_rank_tokens_in_flight", f'{{rank="{r}"}}') for r in "01"] == [0, 0]
        health = _wait_for(lambda: (h := httpx.get(server.url + "/health")).json()["status"] == "degraded" and h,
                           "/health to say degraded")
        assert health.status_code == 200
        assert "data-parallel rank 1" in health.json()["reason"] and "SIGKILL" in health.json()["reason"]
        with ThreadPoolExecutor(4) as workers:
            answers = list(workers.map(lambda i: _complete(server.url, i), range(4)))
        assert [a.json()["choices"][0]["text"] for a in answers] == reference["short"][:4]
        assert metric(metrics(server.url), "fd_dp_rank_up", '{rank="1"}') == 0
        assert server.proc.poll() is None, "fd-serve exited though rank 0 still serves"
        _wait_for(lambda: metric(t := metrics(server.url), "fd_dp_rank_kv_cache_blocks_free", '{rank="0"}')
                  == metric(t, "fd_dp_rank_kv_cache_blocks_total", '{rank="0"}') > 0, "every KV block free on rank 0")
    finally:
        assert server.stop() == 0, server.log()


def test_the_offline_engine_refuses_data_parallel_naming_the_key(tiny_model) -> None:
    from fd_core.engine.llm import LLM
    from fd_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_size: 2: an in-process engine is one rank"):
        LLM(str(tiny_model), parallel={"data_parallel_size": 2})


def test_the_offline_engine_runs_auto_as_one_rank(tiny_model) -> None:
    from fd_core.engine.llm import LLM

    llm = LLM(str(tiny_model), parallel={"data_parallel_size": "auto"}, cache={"num_blocks": 16})
    assert llm.config.parallel.data_parallel_size == 1
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 2


def test_traced_hook_figures_of_the_ranks_are_summed_by_hook_and_plugin() -> None:
    from fd_core.server.data_parallel import _sum_stats

    rank = lambda calls, seconds: {"hooks": [{"hook": "fd_order_waiting", "plugin": "p", "calls": calls,  # noqa: E731
                                              "errors": 0, "seconds": seconds}], "num_steps": calls}
    merged = _sum_stats([rank(2, 0.5), rank(3, 0.25)])
    assert merged["hooks"] == [{"hook": "fd_order_waiting", "plugin": "p", "calls": 5, "errors": 0, "seconds": 0.75}]
    assert merged["num_steps"] == 5


# --- the DataParallelClient in-process, against real rank processes ------------------------------

PROMPT_IDS = ([5, 6, 7, 8], [9, 10, 11])


def _request(request_id: str, max_tokens: int, prompt: list[int] = PROMPT_IDS[0]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _run_ranks(tiny_model: Path, body, size: int = 2, observe=None, **settings):
    """Run ``body(client, finished)`` against a started DataParallelClient of ``size`` ranks;
    ``finished`` collects every final output it passes on (what /metrics counts), each also
    given to ``observe`` when set."""
    config = load_config(model={"source": str(tiny_model)}, cache={"num_blocks": 128},
                         parallel={"data_parallel_size": size}, **settings)
    finished: list[RequestOutput] = []

    def on_finished(output: RequestOutput) -> None:
        finished.append(output)
        if observe is not None:
            observe(output)

    async def main():
        client = DataParallelClient(config, log_level="WARNING", on_finished=on_finished)
        try:
            await client.start(timeout=START_TIMEOUT_S)
            return await body(client, finished)
        finally:
            await client.shutdown()

    return asyncio.run(main())


async def _tokens(outputs) -> dict[str, list[int]]:
    """Each request's output tokens; every request must end exactly once."""
    tokens: dict[str, list[int]] = {}
    ends: list[str] = []
    async for output in outputs:
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finished:
            ends.append(output.request_id)
    assert sorted(ends) == sorted(tokens), ends
    return tokens


async def _until(condition, what: str, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _kill(client: DataParallelClient, rank: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(client.ranks[rank]._process.pid, sig)


async def _in_flight(client: DataParallelClient) -> list[int]:
    return [rank["tokens_in_flight"] for rank in (await client.stats())["ranks"]]


async def _all_blocks_free(client: DataParallelClient) -> bool:
    return all(rank["kv"]["num_free_blocks"] == rank["kv"]["num_blocks"]
               for rank in (await client.stats())["ranks"] if rank["up"])


def test_requests_sent_to_a_rank_that_dies_before_acknowledging_them_complete_on_a_live_rank(tiny_model) -> None:
    async def body(client, finished):
        reference = await _tokens(await client.add([_request("ref-a", 40), _request("ref-b", 40, PROMPT_IDS[1])]))
        busy = await client.add([_request("busy", 300)])                      # rank 0: the next call goes to rank 1
        _kill(client, 1, signal.SIGSTOP)                                        # rank 1 cannot acknowledge
        sending = asyncio.create_task(client.add([_request("a", 40), _request("b", 40, PROMPT_IDS[1])]))
        await asyncio.sleep(0)                                                  # sent to rank 1; waiting for its ACK
        assert not sending.done()
        _kill(client, 1)
        moved = await _tokens(await asyncio.wait_for(sending, 60))
        assert moved == {"a": reference["ref-a"], "b": reference["ref-b"]}
        await _tokens(busy)
        assert client.num_rescued == 2
        assert [o.request_id for o in finished].count("a") == 1
        assert await _in_flight(client) == [0, 0]
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body)


def test_a_dead_ranks_late_final_output_does_not_unplace_the_request_continued_elsewhere(tiny_model) -> None:
    async def body(client, finished):
        reference = await _tokens(await client.add([_request("ref", 200)]))
        outputs = aiter(await client.add([_request("x", 200)]))                # rank 0 (both idle)
        first = await anext(outputs)
        _kill(client, 0)
        await _until(lambda: client.num_rescued == 1, "the stream to continue on rank 1")
        # what rank 0 sent just before it died, read after its death was handled (the sentinel and
        # the socket are read in no fixed order): its final output for "x"
        late = RequestOutput("x", new_token_ids=[1], finished=True, finish_reason=FinishReason.LENGTH,
                             num_prompt_tokens=4, num_output_tokens=200)
        client.ranks[0]._handle([wire.OUTPUTS, [wire.encode_output(late)]])
        assert await _in_flight(client) == [0, len(PROMPT_IDS[0]) + 200], "the continuation was un-placed"
        rest = await _tokens(outputs)
        assert first.new_token_ids + rest["x"] == reference["ref"]
        assert [o.request_id for o in finished].count("x") == 1
        assert await _in_flight(client) == [0, 0]
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body)


def test_a_refused_continuation_fails_its_stream_and_leaves_no_load_behind(tiny_model) -> None:
    prompt = len(PROMPT_IDS[0])

    async def body(client, finished):
        first = aiter(await client.add([_request("r0", 150)]))   # rank 0 (one sequence per rank)
        await anext(first)                                         # running: the next one on rank 0 waits
        doomed = await client.add([_request("x", 450)])    # rank 1
        third = await client.add([_request("r2", 400)])    # rank 2, running
        queued = await client.add([_request("q0", 20)])    # rank 0 (least loaded): queued, its queue now full
        _kill(client, 1)                                    # x goes to rank 0, which refuses it: queue full
        with pytest.raises(EngineDeadError, match="rank 0 could not take the request over: .*queue is full"):
            await _tokens(doomed)
        for stream in (first, queued, third):
            await _tokens(stream)
        assert await _in_flight(client) == [0, 0, 0]
        streams = [await client.add([_request(name, 200)]) for name in ("a", "b")]
        assert await _in_flight(client) == [prompt + 200, 0, prompt + 200], "new requests not balanced"
        for stream in streams:
            await _tokens(stream)
        assert await _in_flight(client) == [0, 0, 0]
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body, size=3, engine={"max_num_seqs": 1}, server={"max_queue_size": 1})


def test_a_continuation_whose_new_rank_dies_before_acknowledging_it_moves_on_again(tiny_model) -> None:
    async def body(client, finished):
        reference = await _tokens(await client.add([_request("ref", 200)]))
        outputs = aiter(await client.add([_request("x", 200)]))                # rank 0 (all idle)
        first = await anext(outputs)
        _kill(client, 1, signal.SIGSTOP)                                        # rank 1 cannot acknowledge
        _kill(client, 0)
        await _until(lambda: client.num_rescued == 1, "the continuation to be sent to rank 1")
        _kill(client, 1)
        rest = await _tokens(outputs)
        assert first.new_token_ids + rest["x"] == reference["ref"]
        assert client.num_rescued == 2
        assert [o.request_id for o in finished].count("x") == 1
        assert await _in_flight(client) == [0, 0, 0]
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body, size=3)


def test_a_rank_the_front_end_gives_up_on_is_killed_and_its_requests_continue_elsewhere(tiny_model) -> None:
    def observe(output):
        if output.request_id == "boom":
            raise RuntimeError("metrics bug")

    async def body(client, finished):
        reference = await _tokens(await client.add([_request("ref", 200)]))
        x = aiter(await client.add([_request("x", 200)]))                      # rank 0
        other = await client.add([_request("other", 300)])                     # rank 1
        boom = await client.add([_request("boom", 4)])                          # rank 0: its final breaks the reader
        with pytest.raises(EngineDeadError, match="rank 0: the front end stopped reading .*metrics bug"):
            await _tokens(boom)
        process = client.ranks[0]._process
        await asyncio.get_running_loop().run_in_executor(None, process.join, 20)
        assert process.exitcode == -signal.SIGKILL, "rank 0 was left running its requests"
        assert (await _tokens(x))["x"] == reference["ref"]
        await _tokens(other)
        assert await _in_flight(client) == [0, 0]
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body, observe=observe)


def test_a_speculating_request_continued_on_another_rank_keeps_its_tokens(tiny_model) -> None:
    """Both ranks speculate (the model as its own draft); the rank holding a request that has streamed
    some tokens dies: the other rank's draft rebuilds from the delivered tokens, and the output equals
    one uninterrupted run."""
    async def body(client, finished):
        reference = await _tokens(await client.add([_request("ref", 400)]))
        stream = aiter(await client.add([_request("x", 400)]))
        rank = client._placed["x"].rank
        got: list[int] = []
        while len(got) < 10:
            got += (await anext(stream)).new_token_ids
        _kill(client, rank)
        async for output in stream:
            got += output.new_token_ids
        assert got == reference["ref"]
        assert client.num_rescued == 1
        stats = await client.stats()
        assert stats["num_accepted_tokens"] > 0
        assert await _all_blocks_free(client)

    _run_ranks(tiny_model, body, proposer={"name": "draft", "options": {"model": str(tiny_model)}})
