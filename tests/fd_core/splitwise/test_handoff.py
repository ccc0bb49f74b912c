"""The hand-off between a prefill and a decode engine in one process, stepped by hand (real zmq
sockets on loopback, a real Redis directory): outputs equal one mixed engine's, blocks free."""

from __future__ import annotations

import time

import pytest

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.request import Request, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 31] * 3, [11, 12, 13], list(range(40, 90))]


def _config(tiny_model_dir, redis_url: str | None, role: str, connector: str = "zmq", **extra):
    sections = {"model": {"source": tiny_model_dir}, "cache": {"num_blocks": 64, "block_size": 8}, **extra}
    if role != "mixed":
        sections.update(splitwise={"role": role, "heartbeat_s": 0.1, "stall_timeout_s": 1.0},
                        scheduler={"name": "splitwise", "options": {"url": redis_url, "heartbeat_s": 0.1,
                                                                     "lease_s": 1.0}},
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
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    want = _run_all([mixed], [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)], mixed)
    got = _run_all([prefill, decode], [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)], decode)
    for request_id, outputs in want.items():
        assert [o.new_token_ids for o in got[request_id]] == [o.new_token_ids for o in outputs]
        assert "".join(o.new_text for o in got[request_id]) == "".join(o.new_text for o in outputs)
        assert [t.token_id for o in got[request_id] for t in o.new_logprobs] == \
            [t.token_id for o in outputs for t in o.new_logprobs]
    deadline = time.monotonic() + 5
    while prefill.resource_manager.num_free_blocks() < prefill.limits.num_blocks and time.monotonic() < deadline:
        prefill.step()   # the ACKs free the prefill side's blocks
        time.sleep(0.01)
    assert prefill.resource_manager.num_free_blocks() == prefill.limits.num_blocks
    assert decode.resource_manager.num_free_blocks() == decode.limits.num_blocks
    stats = decode.stats().splitwise
    assert stats["transfers_done"] == len(PROMPTS) and stats["blocks_received"] == sum(-(-len(p) // 8) for p in PROMPTS)
    assert prefill.stats().splitwise["jobs_done"] == len(PROMPTS)
