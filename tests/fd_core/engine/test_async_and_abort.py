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
    llm = AsyncLLM.start(config=config)
    yield llm
    llm.shutdown()


def _free(llm):
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks, stats.num_blocks


def test_stream_deltas_concatenate_to_the_final_text(async_llm):
    async def main():
        deltas, ids = [], []
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        async for out in async_llm.generate("hello world, the", params):
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
        await asyncio.sleep(0.02)  # a few steps: far fewer than 400 tokens, however fast the engine
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


def test_a_plugin_failing_at_admission_refuses_that_request_only(tiny_model_dir):
    import fd_core
    from fd_core.config import load_config
    from fd_core.engine.builder import build_engine
    from fd_core.registry import Registry

    class RefuseOne:
        fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

        @fd_core.hookimpl
        def fd_request_added(self, request):
            if request.request_id == "bad":
                raise RuntimeError("plugin bug")

    registry = Registry.discover()
    registry.plugin_manager.register(RefuseOne())
    config = load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 64})
    llm = AsyncLLM(build_engine(config, registry))
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def last(rid):
        async for out in llm.generate([5, 6, 7], params, request_id=rid):
            final = out
        return final

    async def main():
        return await asyncio.gather(last("bad"), last("good"))

    try:
        bad, good = asyncio.run(main())
        again = asyncio.run(last("later"))            # the engine thread is still alive
    finally:
        llm.shutdown()
    assert bad.finish_reason is FinishReason.ERROR and "plugin bug" in bad.error
    assert good.finish_reason is FinishReason.LENGTH and good.num_output_tokens == 5
    assert again.finish_reason is FinishReason.LENGTH
    assert llm.engine.resource_manager.num_free_blocks() == 64


def test_abort_of_a_request_waiting_inside_the_resource_manager_frees_at_once(tiny_model_dir):
    from fd_core.config import load_config
    from fd_core.engine.builder import build_engine
    from fd_core.request import Request

    engine = build_engine(load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 8, "block_size": 16},
                                      engine={"max_num_seqs": 4, "max_num_batched_tokens": 256}))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request(Request("big", [5] * 80, params))      # takes most of the pool
    engine.add_request(Request("waits", [6] * 60, params))    # cannot get its blocks yet
    engine.step()
    rm = engine.resource_manager
    assert rm.stats().num_running == 1 and rm.stats().num_waiting == 1
    engine.abort("waits")
    engine.abort("big")
    engine.step()
    assert rm.num_free_blocks() == rm.num_blocks
    finals = {o.request_id: o for o in engine.get_results(timeout=0) if o.finished}
    assert {k: v.finish_reason for k, v in finals.items()} == {"big": FinishReason.ABORT, "waits": FinishReason.ABORT}
