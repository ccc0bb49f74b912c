"""The asyncio client: streaming deltas, abort of running and waiting requests, idle blocking."""

from __future__ import annotations

import asyncio

import pytest

from fd_core.engine.async_llm import AsyncLLM
from fd_core.request import FinishReason, SamplingParams


@pytest.fixture
def async_llm(tiny_model_dir):
    from fd_core.config import load_config

    config = load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 64},
                         engine={"max_num_seqs": 2, "max_num_batched_tokens": 256})
    llm = AsyncLLM.from_config(config)
    yield llm
    llm.shutdown()


def _free(llm):
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks, stats.num_blocks


def test_stream_deltas_concatenate_to_the_final_text(async_llm):
    async def main():
        deltas, ids = [], []
        async for out in async_llm.generate("hello world, the", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)):
            deltas.append(out.new_text)
            ids.extend(out.new_token_ids)
            last = out
        return deltas, ids, last

    deltas, ids, last = asyncio.run(main())
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    assert len(ids) == 20
    assert "".join(deltas) == async_llm.engine.tokenizer.decode(ids)


def test_abort_running_and_waiting_frees_blocks_at_once(async_llm):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        streams = [async_llm.generate([7] * 30, long, request_id=f"r{i}") for i in range(3)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams[:2]]
        await asyncio.gather(*firsts)                         # r0, r1 running (max_num_seqs=2)
        third = asyncio.ensure_future(streams[2].__anext__())  # r2 queued behind them
        await asyncio.sleep(0.2)
        running_free = _free(async_llm)[0]
        for rid in ("r0", "r1", "r2"):
            async_llm.abort(rid)
        finals = []
        for s in streams[:2]:
            async for out in s:
                last = out
            finals.append(last)
        finals.append(await third)
        return running_free, finals

    running_free, finals = asyncio.run(main())
    assert running_free < _free(async_llm)[1]   # blocks were in use while running
    assert [f.finish_reason for f in finals] == [FinishReason.ABORT] * 3
    assert all(f.finished for f in finals)
    free, total = _free(async_llm)
    assert free == total
    assert not async_llm.engine.has_unfinished()


def test_leaving_a_stream_early_aborts_it(async_llm):
    async def main():
        stream = async_llm.generate([9] * 20, SamplingParams(max_tokens=400, ignore_eos=True), request_id="gone")
        await stream.__anext__()
        await stream.aclose()            # the client went away
        for _ in range(100):
            if not async_llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    free, total = _free(async_llm)
    assert free == total and not async_llm.engine.has_unfinished()


def test_a_failing_step_fails_in_flight_requests_instead_of_hanging(async_llm):
    runner = async_llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_execute(plan)

    runner.execute = flaky

    async def main():
        outs = []
        async for out in async_llm.generate([5] * 10, SamplingParams(max_tokens=50, ignore_eos=True)):
            outs.append(out)
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.finish_reason is FinishReason.ERROR
    assert "device fell over" in last.error
    free, total = _free(async_llm)
    assert free == total
