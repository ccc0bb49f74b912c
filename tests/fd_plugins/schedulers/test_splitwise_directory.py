"""The ``splitwise`` scheduler's peer directory against a real redis-server: entries it cannot read
(damaged, from another fd-engine version, or a set member that is not UTF-8) are left out; the others are still listed.
A stopped Redis holds up none of its callers."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict

import redis

from fd_core.contracts.scheduler import PeerInfo
from fd_core.registry import Registry
from fd_plugins.schedulers.splitwise import SplitwiseScheduler, SplitwiseSchedulerSettings


def _member(url: str, **options) -> SplitwiseScheduler:
    settings = SplitwiseSchedulerSettings(url=url, heartbeat_s=0.05, lease_s=1.0, **options)
    return SplitwiseScheduler(settings, hooks=Registry.from_plugins({}).hooks, max_queue_size=4)


def _peer(name: str, role: str) -> PeerInfo:
    return PeerInfo(name, role, f"tcp://127.0.0.1:1/{name}", "zmq", "host", "layout")


def test_unreadable_directory_entries_are_left_out_and_the_rest_listed(redis_server) -> None:
    decode, prefill = _member(redis_server.url), _member(redis_server.url)
    try:
        decode.join(_peer("d", "decode"))
        prefill.join(_peer("p", "prefill"))
        client = redis.Redis.from_url(redis_server.url)
        prefix = prefill._prefix
        newer = {**asdict(_peer("p-newer", "prefill")), "tls_fingerprint": "ab:cd"}   # a field we do not know
        for name, entry in (("p-damaged", b"{not json"), ("p-newer", json.dumps(newer).encode())):
            client.set(f"{prefix}:peer:{name}", entry, px=60_000)
            client.sadd(f"{prefix}:peers", name)
        client.sadd(f"{prefix}:peers", b"\xff\xfe")   # a member no instance wrote: not even UTF-8
        assert _wait_for(lambda: _listed(decode) == ["p"]), _listed(decode)
        assert _wait_for(lambda: _listed(decode) != ["p"], timeout=1.0) is False   # later listings: the same
    finally:
        decode.close()
        prefill.close()


def _listed(directory: SplitwiseScheduler) -> list[str]:
    return [p.instance_id for p in directory.peers("prefill")]


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_paused_redis_holds_up_no_caller_of_the_directory(redis_server) -> None:
    """The directory's Redis I/O runs on its own thread: with redis-server stopped (SIGSTOP: calls
    hang until socket_timeout_s, 60 s here), peers(), report_load() and stats() still return, from the
    listing read before the pause."""
    decode = _member(redis_server.url, socket_timeout_s=60.0)
    prefill = _member(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    pid = client.info("server")["process_id"]
    try:
        decode.join(_peer("d", "decode"))
        prefill.join(_peer("p", "prefill"))
        assert _wait_for(lambda: _listed(decode) == ["p"])
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)   # > heartbeat_s: a new listing is due (and the directory thread is stuck in Redis)
            answers: list = []
            caller = threading.Thread(target=lambda: answers.extend(
                [_listed(decode), decode.report_load(7), decode.stats()["peers_prefill"]]))
            caller.start()
            caller.join(timeout=20)   # well under the 60 s a Redis call would wait
            assert not caller.is_alive(), "a caller of the directory waited on the stopped Redis"
            assert answers == [["p"], None, 1]
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        decode.close()
        prefill.close()
