"""The ``splitwise`` scheduler's peer directory against a real redis-server: entries it cannot read
(damaged, or from another fd-engine version) are left out; the others are still listed."""

from __future__ import annotations

import json
from dataclasses import asdict

import redis

from fd_core.contracts.scheduler import PeerInfo
from fd_core.registry import Registry
from fd_plugins.schedulers.splitwise import SplitwiseScheduler, SplitwiseSchedulerSettings


def _member(url: str) -> SplitwiseScheduler:
    settings = SplitwiseSchedulerSettings(url=url, heartbeat_s=0.05, lease_s=1.0)
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
        for _ in range(2):   # listed again after a refresh: still only the readable entry
            assert [p.instance_id for p in decode.peers("prefill")] == ["p"]
            decode._listed_at = 0.0
    finally:
        decode.close()
        prefill.close()
