"""One owner of a request's end, unique live ids, and plugins that misbehave are contained."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter

import pytest

import fd_core
from fd_core.config import load_config
from fd_core.engine.async_llm import AsyncLLM
from fd_core.engine.builder import build_engine
from fd_core.errors import PluginError, RequestError
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams
from fd_core.server import wire
from fd_core.server.engine_process import _add

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(tiny_model_dir, *general, **sections):
    registry = Registry.discover()
    for plugin in general:
        registry.plugin_manager.register(plugin)
    sections.setdefault("cache", {"num_blocks": 64})
    return build_engine(load_config(model={"source": tiny_model_dir}, **sections), registry)


def _drain(engine, max_steps=500):
    finals = {}
    for _ in range(max_steps):
        engine.step()
        for output in engine.get_results(timeout=0):
            if output.finished:
                assert output.request_id not in finals, f"two final outputs for {output.request_id}"
                finals[output.request_id] = output
        if not engine.has_unfinished():
            return finals
    raise AssertionError("the engine did not drain")


class FinishCounter:
    """Counts ``fd_request_finished`` per request id."""

    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    def __init__(self):
        self.calls = Counter()

    @fd_core.hookimpl
    def fd_request_finished(self, request, output):
        assert request.status is RequestStatus.FINISHED and output.finished
        self.calls[request.request_id] += 1


def test_every_end_tells_each_seam_once_and_frees_every_block(tiny_model_dir):
    counter = FinishCounter()
    engine = _engine(tiny_model_dir, counter)
    forgotten = Counter()
    forget = engine.token_processor.forget
    engine.token_processor.forget = lambda rid: (forgotten.update([rid]), forget(rid))
    engine.add_request(Request("length", [5, 6, 7], PARAMS))
    engine.add_request(Request("stop", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0,
                                                                stop_token_ids=list(range(512)), min_tokens=2)))
    engine.add_request(Request("aborted", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
    engine.step()
    engine.abort("aborted")
    engine.abort("aborted")        # twice: still one end
    finals = _drain(engine)
    assert {k: v.finish_reason for k, v in finals.items()} == {
        "length": FinishReason.LENGTH, "stop": FinishReason.STOP, "aborted": FinishReason.ABORT}
    assert counter.calls == Counter({"length": 1, "stop": 1, "aborted": 1})
    assert forgotten == Counter({"length": 1, "stop": 1, "aborted": 1})
    for output in finals.values():   # the core fills the final metrics
        assert output.metrics is not None and output.metrics.e2e is not None
    stats = engine.resource_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_live_duplicate_id_is_refused_and_the_first_request_is_untouched(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.add_request(Request("same", [5, 6, 7], PARAMS))
    engine.step()
    with pytest.raises(RequestError, match="'same' is already in use") as info:
        engine.add_request(Request("same", [9, 9, 9], PARAMS))
    assert info.value.field == "request_id"
    finals = _drain(engine)
    first = finals["same"]
    assert first.finish_reason is FinishReason.LENGTH and first.num_output_tokens == PARAMS.max_tokens
    assert engine.token_processor._states == {}
    # once its final output has been read, the id may be used again
    engine.add_request(Request("same", [9, 9, 9], PARAMS))
    assert _drain(engine)["same"].num_prompt_tokens == 3


def test_async_llm_refuses_a_live_duplicate_id(tiny_model_dir):
    llm = AsyncLLM(_engine(tiny_model_dir))
    slow = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        # the first stream stays live until its final output is read, however fast the engine is
        stream = llm.generate([5, 6, 7], slow, request_id="dup")
        final = await anext(stream)
        assert not final.finished
        with pytest.raises(RequestError, match="already in use"):
            async for _ in llm.generate([5, 6, 7], PARAMS, request_id="dup"):
                pass
        async for output in stream:
            final = output
        return final

    try:
        first = asyncio.run(main())
    finally:
        llm.shutdown()
    assert first.finish_reason is FinishReason.LENGTH and first.num_output_tokens == 40


class RecordingSender:
    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


def test_the_engine_process_rejects_a_duplicate_id_by_field(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    sender = RecordingSender()
    message = wire.encode_request(Request("x", [5, 6, 7], PARAMS))
    _add(engine, message, sender)
    _add(engine, message, sender)
    assert sender.messages[0] == [wire.ACK, "x"]
    kind, request_id, reject, field, text = sender.messages[1]
    assert (kind, request_id, reject, field) == (wire.REJECT, "x", wire.INVALID, "request_id")
    assert _drain(engine)["x"].num_output_tokens == PARAMS.max_tokens


def test_a_scheduler_failing_in_put_request_rejects_only_that_request(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    put = engine.scheduler.put_request

    def flaky(request):
        if request.request_id == "boom":
            raise KeyError("plugin bug")
        put(request)

    engine.scheduler.put_request = flaky
    sender = RecordingSender()
    _add(engine, wire.encode_request(Request("boom", [5, 6], PARAMS)), sender)
    _add(engine, wire.encode_request(Request("fine", [5, 6], PARAMS)), sender)
    (kind, _, reject, plugin, text), ack = sender.messages
    assert (kind, reject) == (wire.REJECT, wire.INTERNAL)
    assert plugin.startswith("local (fd_plugins.schedulers.local:LocalScheduler)")
    assert "put_request failed on request 'boom': KeyError" in text
    assert ack == [wire.ACK, "fine"]
    assert _drain(engine)["fine"].finish_reason is FinishReason.LENGTH
    with pytest.raises(PluginError, match="put_request failed"):   # the same through the offline API
        engine.add_request(Request("boom", [5, 6], PARAMS))


class BadOrder:
    """An ordering hook that answers something other than a permutation, then raises."""

    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    def __init__(self, mode):
        self.mode = mode
        self.calls = 0

    @fd_core.hookimpl
    def fd_order_waiting(self, waiting, now):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("ordering bug")
        return waiting[:1] if len(waiting) > 1 else []


@pytest.mark.parametrize("mode", ["not a permutation", "raise"])
def test_a_misbehaving_order_hook_is_reported_once_and_fifo_is_used(tiny_model_dir, caplog, mode):
    hook = BadOrder(mode)
    engine = _engine(tiny_model_dir, hook)
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            engine.add_request(Request(f"r{i}", [5, 6, 7], PARAMS))
        finals = _drain(engine)
        engine.add_request(Request("later", [5, 6, 7], PARAMS))
        finals |= _drain(engine)
    assert {k: v.finish_reason for k, v in finals.items()} == dict.fromkeys(
        ["r0", "r1", "r2", "later"], FinishReason.LENGTH)
    reports = [r.getMessage() for r in caplog.records
               if "fd_order_waiting" in r.getMessage() and r.name != "fd_core.registry"]  # not the typo plugin
    assert len(reports) == 1 and hook.calls >= 2
    assert "hook fd_order_waiting" in reports[0] and "the default was used" in reports[0]


def test_a_scheduler_that_always_fails_does_not_spin_the_loop(tiny_model_dir, caplog):
    engine = _engine(tiny_model_dir)
    calls = Counter()

    def broken(max_num, timeout):
        calls["get_requests"] += 1
        raise RuntimeError("scheduler bug")

    engine.scheduler.get_requests = broken
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop,))
    with caplog.at_level(logging.ERROR):
        thread.start()
        stop.wait(1.0)
        stop.set()
        engine.wake()
        thread.join(10)
    assert not thread.is_alive()
    # backing off from 50 ms (doubling) allows about 5 tries in a second; a spinning loop makes thousands
    assert 1 <= calls["get_requests"] <= 10
    assert len([r for r in caplog.records if r.name == "fd_core.engine.core"]) <= 10


class FailingFinishHook:
    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    @fd_core.hookimpl
    def fd_request_finished(self, request, output):
        raise RuntimeError("lifecycle hook bug")


def test_a_failing_lifecycle_hook_does_not_lose_the_final_output(tiny_model_dir, caplog):
    engine = _engine(tiny_model_dir, FailingFinishHook())
    with caplog.at_level(logging.ERROR):
        for i in range(2):
            engine.add_request(Request(f"r{i}", [5, 6, 7], PARAMS))
        finals = _drain(engine)
    assert {o.finish_reason for o in finals.values()} == {FinishReason.LENGTH} and len(finals) == 2
    assert sum("fd_request_finished raised RuntimeError" in r.getMessage() for r in caplog.records) == 1
    assert engine.resource_manager.num_free_blocks() == 64


def test_tiny_temperatures_are_greedy(make_llm):
    """1e-38 used to overflow float32: every row picked token 0 (empty text, "stop")."""
    llm = make_llm()
    prompt = [5, 17, 99, 3]
    results = llm.generate([prompt] * 3, [SamplingParams(max_tokens=12, temperature=t, ignore_eos=True)
                                          for t in (0.0, 1e-38, 1e-6)])
    greedy, tiny, small = (r.token_ids for r in results)
    assert tiny == greedy and small == greedy
    assert len(set(greedy)) > 1 and results[1].finish_reason is FinishReason.LENGTH


def test_siblings_of_a_large_n_call_do_not_hold_a_later_request_back(tiny_model_dir):
    engine = _engine(tiny_model_dir, engine={"max_num_seqs": 4, "max_num_batched_tokens": 256})
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(16):   # one client call with n=16
        engine.add_request(Request(f"big-{i}", [5, 6, 7], long, group_id="big"))
    engine.add_request(Request("small", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                               group_id="small"))
    order = []
    for _ in range(500):
        engine.step()
        order += [o.request_id for o in engine.get_results(timeout=0) if o.finished]
        if not engine.has_unfinished():
            break
    assert len(order) == 17 and order[0] == "small"


def test_busy_and_runner_seconds_count_steps_that_ran_a_batch_only(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.step()   # nothing to do
    idle = engine.stats()
    assert idle.busy_seconds == idle.runner_seconds == 0.0 and idle.cpu_seconds > 0
    engine.add_request(Request("timed", [5, 6, 7], PARAMS))
    started = time.perf_counter()
    _drain(engine)
    elapsed = time.perf_counter() - started
    for _ in range(3):
        engine.step()   # idle again: nothing more counted
    stats = engine.stats()
    assert 0 < stats.runner_seconds < stats.busy_seconds <= elapsed
    assert stats.cpu_seconds > idle.cpu_seconds
