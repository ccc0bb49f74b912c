"""The hand-off between a prefill and a decode engine in one process, stepped by hand (real zmq
sockets on loopback, a real Redis directory): outputs equal one mixed engine's, blocks free."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.outputs import SampledToken
from fd_core.request import Request, SamplingParams
from fd_core.server import wire
from fd_core.splitwise import protocol

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 31] * 3, [11, 12, 13], list(range(40, 90))]


def _config(tiny_model_dir, redis_url: str | None, role: str, connector: str = "zmq", *,
            handoff: dict | None = None, directory: dict | None = None, **extra):
    sections = {"model": {"source": tiny_model_dir}, "cache": {"num_blocks": 64, "block_size": 8}, **extra}
    if role != "mixed":
        sections.update(splitwise={"role": role, "heartbeat_s": 0.1, "stall_timeout_s": 1.0, "peer_wait_s": 1.0,
                                   **(handoff or {})},
                        scheduler={"name": "splitwise", "options": {"url": redis_url, "heartbeat_s": 0.1,
                                                                     "lease_s": 1.0, **(directory or {})}},
                        connector={"name": connector})
    return load_config(**sections)


def _run_all(engines, requests, target, timeout=60.0):
    """Step every engine in turn until each request added to ``target`` finished; outputs by id."""
    for request in requests:
        target.add_request(request)
    done: dict[str, list] = {r.request_id: [] for r in requests}
    deadline = time.monotonic() + timeout
    while any(not outs or not outs[-1].finished for outs in done.values()):
        assert time.monotonic() < deadline, f"not finished: {done}"
        for engine in engines:
            engine.step()
        for output in target.get_results(timeout=0):
            done[output.request_id].append(output)
        time.sleep(0.001)
    return done


@pytest.fixture(params=["zmq", "shm"])
def pair(request, tiny_model_dir, redis_server):
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", request.param))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", request.param))
    yield prefill, decode
    decode.close()
    prefill.close()


@pytest.mark.parametrize("logprobs", [None, 2])
def test_prefill_then_decode_gives_the_mixed_engine_output(tiny_model_dir, pair, logprobs):
    prefill, decode = pair
    mixed = build_engine(_config(tiny_model_dir, None, "mixed"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=logprobs)
    want = _run_all([mixed], [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)], mixed)
    got = _run_all([prefill, decode], [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)], decode)
    for request_id, outputs in want.items():
        assert [o.new_token_ids for o in got[request_id]] == [o.new_token_ids for o in outputs]
        assert "".join(o.new_text for o in got[request_id]) == "".join(o.new_text for o in outputs)
        assert [t.token_id for o in got[request_id] for t in o.new_logprobs] == \
            [t.token_id for o in outputs for t in o.new_logprobs]
        # the prompt logprobs come from the prefill instance, with the first token
        assert [o.prompt_logprobs is not None for o in got[request_id]] == [o.prompt_logprobs is not None
                                                                            for o in outputs]
        if logprobs is not None:
            prompt, expected = got[request_id][0].prompt_logprobs, outputs[0].prompt_logprobs
            assert [(t.token_id, [i for i, _ in t.top_logprobs]) for t in prompt] == \
                [(t.token_id, [i for i, _ in t.top_logprobs]) for t in expected]
            assert [t.logprob for t in prompt] == pytest.approx([t.logprob for t in expected], abs=1e-4)
            assert len(prompt) == len(PROMPTS[int(request_id[1:])]) - 1
    deadline = time.monotonic() + 5
    while prefill.resource_manager.num_free_blocks() < prefill.limits.num_blocks and time.monotonic() < deadline:
        prefill.step()   # the ACKs free the prefill side's blocks
        time.sleep(0.01)
    assert prefill.resource_manager.num_free_blocks() == prefill.limits.num_blocks
    assert decode.resource_manager.num_free_blocks() == decode.limits.num_blocks
    stats = decode.stats().splitwise
    assert stats["transfers_done"] == len(PROMPTS) and stats["blocks_received"] == sum(-(-len(p) // 8) for p in PROMPTS)
    assert prefill.stats().splitwise["jobs_done"] == len(PROMPTS)


def _drain_blocks(engines, timeout=5.0):
    """Step until every engine's pool is free again (ACKs and aborts arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(e.resource_manager.num_free_blocks() == e.limits.num_blocks for e in engines):
            return
        for engine in engines:
            engine.step()
        time.sleep(0.01)
    raise AssertionError([e.resource_manager.stats() for e in engines])


def test_a_decode_instance_without_room_waits_and_no_prefill_is_wasted(tiny_model_dir, redis_server):
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill"))
    # 6 blocks of 8 tokens: one 30-token prompt + 10 outputs (5 blocks) at a time
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", cache={"num_blocks": 6, "block_size": 8}))
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        requests = [Request(f"r{i}", [(7 * i + t) % 500 + 1 for t in range(30)], params) for i in range(3)]
        for request in requests:
            decode.add_request(request)
        decode.step()
        assert decode.stats().splitwise["waiting_for_blocks"] == 2   # one reserved, two wait for its blocks
        done = _run_all([prefill, decode], [], decode)
        assert not done
        finished = {}
        deadline = time.monotonic() + 60
        while len(finished) < 3 and time.monotonic() < deadline:
            for engine in (prefill, decode):
                engine.step()
            for output in decode.get_results(timeout=0):
                if output.finished:
                    finished[output.request_id] = output
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert all(o.finish_reason.value == "length" and not o.error for o in finished.values())
        _drain_blocks([prefill, decode])
        figures = prefill.stats().splitwise
        # each prompt computed exactly once: nothing computed and then dropped
        assert figures["jobs_received"] == figures["jobs_done"] == 3 and figures.get("jobs_aborted", 0) == 0
        assert prefill.stats().num_prompt_tokens == 90
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_instance_that_leaves_is_replaced_and_the_output_is_unchanged(tiny_model_dir, redis_server):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mixed = build_engine(_config(tiny_model_dir, None, "mixed"))
    want = _run_all([mixed], [Request("r", PROMPTS[2], params)], mixed)["r"]
    first = build_engine(_config(tiny_model_dir, redis_server.url, "prefill"))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode"))
    second = None
    try:
        decode.add_request(Request("r", PROMPTS[2], params))
        deadline = time.monotonic() + 10
        while first.stats().splitwise.get("jobs_received", 0) == 0:   # the only prefill instance took it ...
            assert time.monotonic() < deadline
            decode.step()
            time.sleep(0.01)
        first.handoff.close()   # ... and leaves before computing it (it tells the decode side; its engine
        #                         is never stepped again). A silent one: tests/fd_core/server/test_splitwise.py
        second = build_engine(_config(tiny_model_dir, redis_server.url, "prefill"))
        got = _run_all([second, decode], [], decode)
        outputs = []
        deadline = time.monotonic() + 30
        while not outputs or not outputs[-1].finished:
            assert time.monotonic() < deadline
            for engine in (second, decode):
                engine.step()
            outputs += decode.get_results(timeout=0)
        assert not got
        assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in want]
        figures = decode.stats().splitwise
        assert figures["prefill_attempts_failed"] == 1 and figures["transfers_done"] == 1
        _drain_blocks([second, decode])
    finally:
        decode.close()
        first.close()
        if second is not None:
            second.close()


def _first_outputs(engine, request, timeout=10.0):
    """Add ``request`` (if any) and step ``engine`` alone until it has outputs (an error needs no peer)."""
    if request is not None:
        engine.add_request(request)
    outputs = []
    deadline = time.monotonic() + timeout
    while not outputs:
        assert time.monotonic() < deadline
        engine.step()
        outputs += engine.get_results(timeout=0.01)
    return outputs


def test_without_any_prefill_instance_the_request_fails_within_peer_wait_s(tiny_model_dir, redis_server):
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", handoff=NO_STALL))
    try:   # a directory member no instance wrote (not UTF-8) is no reason to wait forever
        redis.Redis.from_url(redis_server.url).sadd(f"{decode.scheduler._prefix}:peers", b"\xff\xfe")
        outputs = _first_outputs(decode, Request("r", PROMPTS[1], SamplingParams(max_tokens=4)))
        assert outputs[-1].finished and outputs[-1].finish_reason.value == "error"
        assert "no prefill instance was available within 1.0 s (splitwise.peer_wait_s)" in outputs[-1].error
        assert "no live prefill instance with connector 'zmq'" in outputs[-1].error
        assert decode.resource_manager.num_free_blocks() == decode.limits.num_blocks
    finally:
        decode.close()


def test_an_abort_on_the_decode_side_frees_the_prefill_side(tiny_model_dir, pair):
    prefill, decode = pair
    decode.add_request(Request("r", PROMPTS[2], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
    deadline = time.monotonic() + 10
    while prefill.stats().splitwise.get("jobs_received", 0) == 0:
        assert time.monotonic() < deadline
        decode.step()
        time.sleep(0.01)
    prefill.step()   # computes the prompt and ships it; its blocks stay held until the decode side answers
    assert prefill.resource_manager.num_free_blocks() < prefill.limits.num_blocks
    decode.abort("r")
    _drain_blocks([prefill, decode])
    final = [o for o in decode.get_results(timeout=0) if o.finished]
    assert final and final[-1].finish_reason.value == "abort"


def test_an_instance_of_another_kv_layout_is_never_paired_and_the_error_says_why(tiny_model_dir, redis_server):
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill",
                                   cache={"num_blocks": 64, "block_size": 16}))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode"))   # block_size 8
    try:
        outputs = _first_outputs(decode, Request("r", PROMPTS[1], SamplingParams(max_tokens=4)))
        assert outputs[-1].finish_reason.value == "error"
        assert "registered but unfit" in outputs[-1].error and "block_size=16" in outputs[-1].error
        assert prefill.stats().splitwise.get("jobs_received", 0) == 0
    finally:
        decode.close()
        prefill.close()


def test_a_stopped_redis_holds_up_no_hand_off(tiny_model_dir, redis_server):
    """The directory's Redis I/O is off the hand-off's path: with redis-server stopped (SIGSTOP; a
    Redis call would wait socket_timeout_s, 60 s here), a new request is still handed off and answered."""
    directory = {"socket_timeout_s": 60.0}
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", directory=directory))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", directory=directory))
    pid = redis.Redis.from_url(redis_server.url).info("server")["process_id"]
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)   # the listing read before the pause is now older than heartbeat_s: a read is due
            outputs = _run_all([prefill, decode], [Request("r", PROMPTS[0], params)], decode, timeout=30)["r"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outputs[-1].finish_reason.value == "length" and not outputs[-1].error
        assert decode.stats().splitwise["transfers_done"] == 1
        _drain_blocks([prefill, decode])
    finally:
        decode.close()
        prefill.close()


#: Hand-off timers under which a lost message is found by the protocol, never by a peer's silence.
NO_STALL = {"stall_timeout_s": 60.0}


def _lose_first(engine, kind: str, *, taken: bool = True) -> list[dict]:
    """Make ``engine``'s real connector lose the first ``kind`` message it is given: reported as
    taken, as a message lost on the way is (a socket closed with it queued), or (``taken=False``)
    refused, as by a full send queue."""
    connector = engine.handoff.connector
    send, lost = connector.send, []

    def lossy(peer, message, buffers=()):
        if message["kind"] == kind and not lost:
            lost.append(message)
            return taken
        return send(peer, message, buffers)

    connector.send = lossy
    return lost


def test_a_done_lost_on_the_way_is_asked_again_and_the_output_is_unchanged(tiny_model_dir, redis_server):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mixed = build_engine(_config(tiny_model_dir, None, "mixed"))
    want = _run_all([mixed], [Request("r", PROMPTS[0], params)], mixed)["r"]
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", handoff=NO_STALL))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", handoff=NO_STALL))
    try:
        lost = _lose_first(prefill, protocol.DONE)
        got = _run_all([prefill, decode], [Request("r", PROMPTS[0], params)], decode, timeout=30)["r"]
        assert lost and [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
        figures = decode.stats().splitwise
        assert figures["prefill_attempts_failed"] == 1 and figures["transfers_done"] == 1
        _drain_blocks([prefill, decode])
    finally:
        decode.close()
        prefill.close()


def test_a_done_the_connector_does_not_take_ends_the_hand_off_on_both_sides(tiny_model_dir, redis_server):
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", handoff=NO_STALL))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", handoff=NO_STALL))
    try:
        refused = _lose_first(prefill, protocol.DONE, taken=False)
        outputs = _run_all([prefill, decode], [Request("r", PROMPTS[0], SamplingParams(max_tokens=4))], decode)["r"]
        assert refused and outputs[-1].finish_reason.value == "error"   # the only prefill instance was tried
        assert f"{prefill.handoff.me.instance_id}: DONE was not taken by the connector" in outputs[-1].error
        assert prefill.stats().splitwise["jobs_given_up"] == 1
        _drain_blocks([prefill, decode])
    finally:
        decode.close()
        prefill.close()


def test_an_incomplete_hand_off_frees_the_prefill_side_at_once(tiny_model_dir, redis_server):
    handoff = {**NO_STALL, "max_prefill_attempts": 1}
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", handoff=handoff))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", handoff=handoff))
    try:
        lost = _lose_first(prefill, protocol.BLOCK)
        outputs = _run_all([prefill, decode], [Request("r", PROMPTS[0], SamplingParams(max_tokens=4))], decode)["r"]
        _drain_blocks([prefill, decode], timeout=10)   # not after stall_timeout_s (60 s)
        assert lost and outputs[-1].finish_reason.value == "error"
        assert f"last: {prefill.handoff.me.instance_id}: 2 of 3 blocks arrived before its DONE" in outputs[-1].error
        assert prefill.stats().splitwise.get("jobs_aborted", 0) == 1
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_instance_shutting_down_tells_the_decode_side_before_it_closes(tiny_model_dir, redis_server):
    """Its ABORT is its first message to that decode instance (its first ALIVE would come after
    heartbeat_s, 5 s here), over a connection opened just then: closed at once, it would be dropped."""
    quiet = {**NO_STALL, "heartbeat_s": 5.0}
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", handoff=quiet))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", handoff=NO_STALL))
    try:
        decode.add_request(Request("r", PROMPTS[2], SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 10
        while prefill.stats().splitwise.get("jobs_received", 0) == 0:
            assert time.monotonic() < deadline
            decode.step()
            time.sleep(0.01)
        prefill.handoff.close()
        outputs = _first_outputs(decode, None)   # within peer_wait_s (1 s), not stall_timeout_s (60 s)
        assert outputs[-1].finish_reason.value == "error"
        assert f"last: {prefill.handoff.me.instance_id}: the prefill instance is shutting down" in outputs[-1].error
        assert decode.resource_manager.num_free_blocks() == decode.limits.num_blocks
    finally:
        decode.close()
        prefill.close()


def _cache_bytes(kv) -> list[bytes]:
    """Every block of a KV cache (all its layers' K and V), by block id."""
    return [b"".join(kv.read(block)) for block in range(kv.num_blocks)]


@pytest.mark.parametrize("connector", ["zmq", "shm"])
def test_messages_about_a_hand_off_from_another_instance_change_nothing(tiny_model_dir, redis_server, connector):
    """A third real connector (prefill role, never asked) sends every BLOCK, the DONE, an ABORT and an
    ALIVE of the open hand-off's id and attempt while the real prefill side is held back (not
    stepped): the decode side writes nothing, neither finishes nor asks again, and counts them;
    then the real prefill side completes it with the mixed engine's output."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mixed = build_engine(_config(tiny_model_dir, None, "mixed"))
    want = _run_all([mixed], [Request("r", PROMPTS[0], params)], mixed)["r"]
    prefill = build_engine(_config(tiny_model_dir, redis_server.url, "prefill", connector, handoff=NO_STALL))
    decode = build_engine(_config(tiny_model_dir, redis_server.url, "decode", connector, handoff=NO_STALL))
    forger = type(decode.handoff.connector)(None, role="prefill", instance_id="forger")
    forger.start()
    try:
        decode.add_request(Request("r", PROMPTS[0], params))
        deadline = time.monotonic() + 10
        while prefill.stats().splitwise.get("jobs_received", 0) == 0:   # asked; not stepped, so it ships nothing
            assert time.monotonic() < deadline
            decode.step()
            time.sleep(0.01)
        kv = decode.handoff.kv
        before = _cache_bytes(kv)
        num_blocks = -(-len(PROMPTS[0]) // 8)
        target, key = decode.handoff.me.address, {"id": "r", "attempt": 1}   # the first attempt's
        for index in range(num_blocks):
            forged = [memoryview(bytearray(b"\x7f" * buffer.nbytes)) for buffer in kv.read(0)]
            assert forger.send(target, {"kind": protocol.BLOCK, **key, "index": index}, forged)
        wrong_first = (want[0].new_token_ids[0] + 1) % 512
        for message in ({"kind": protocol.DONE, **key, "blocks": num_blocks,
                         "token": wire.token_values(SampledToken(wrong_first))},
                        {"kind": protocol.ABORT, **key, "reason": "forged"},
                        {"kind": protocol.ALIVE, "open": [["r", 1, True]]},   # "its DONE was lost": ask again
                        {"kind": protocol.FLUSH}):
            assert forger.send(target, message)
        # the decode side's link thread answers FLUSHED after handling every earlier message of this sender
        deadline = time.monotonic() + 10
        while (delivery := forger.receive(0.1)) is None or delivery.message["kind"] != protocol.FLUSHED:
            assert time.monotonic() < deadline, "the decode side never answered the FLUSH"
        changed = [block for block, (now, then) in enumerate(zip(_cache_bytes(kv), before, strict=True)) if now != then]
        assert not changed, f"the forged BLOCKs were written into the decode side's blocks {changed}"
        decode.step()
        assert decode.get_results(timeout=0) == []   # no first token from the forged DONE
        figures = decode.stats().splitwise
        assert figures.get("prefill_attempts_failed", 0) == 0   # neither the ABORT nor the ALIVE made it ask again
        assert figures["transfers_open"] == 1 and figures.get("blocks_received", 0) == 0
        assert figures["messages_from_another_peer"] == num_blocks + 3
        outputs = []
        deadline = time.monotonic() + 30
        while not outputs or not outputs[-1].finished:
            assert time.monotonic() < deadline
            for engine in (prefill, decode):
                engine.step()
            outputs += decode.get_results(timeout=0)
        assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in want]
        figures = decode.stats().splitwise
        assert figures["transfers_done"] == 1 and figures["blocks_received"] == num_blocks
        assert figures["messages_from_another_peer"] == num_blocks + 3
        _drain_blocks([prefill, decode])
        assert prefill.stats().splitwise["jobs_done"] == 1
    finally:
        forger.close()
        decode.close()
        prefill.close()
