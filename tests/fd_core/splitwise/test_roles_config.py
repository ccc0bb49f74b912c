"""Roles, connectors and their addresses are checked before start-up, each error naming its key."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.errors import ConfigError
from fd_core.selection import resolve

PD = {"scheduler": {"name": "splitwise"}, "connector": {"name": "zmq"}}


def _problems(**sections) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(load_config(**sections))
    return str(info.value)


def test_a_decode_instance_without_a_connector_is_refused():
    text = _problems(splitwise={"role": "decode"}, scheduler={"name": "splitwise"})
    assert "connector.name: splitwise.role is 'decode', which needs a connector" in text and "shm, zmq" in text


def test_a_prefill_instance_needs_a_pairing_scheduler():
    text = _problems(splitwise={"role": "prefill"}, connector={"name": "zmq"})
    assert "scheduler.name: 'local' cannot pair prefill and decode instances" in text


def test_a_mixed_instance_with_a_connector_is_refused():
    assert "connector.name: 'shm' is selected, but splitwise.role is 'mixed'" in _problems(connector={"name": "shm"})


def test_a_decode_instance_caches_no_prefixes():
    text = _problems(splitwise={"role": "decode"}, cache={"enable_prefix_caching": True}, **PD)
    assert "cache.enable_prefix_caching: a decode instance cannot cache prefixes" in text
    assert not resolve(load_config(splitwise={"role": "decode"}, **PD)).enable_prefix_caching
    assert resolve(load_config(splitwise={"role": "prefill"}, **PD)).enable_prefix_caching


def test_prefill_and_decode_run_one_engine_per_server():
    text = _problems(splitwise={"role": "prefill"}, parallel={"data_parallel_size": 2}, **PD)
    assert "parallel.data_parallel_size: a prefill instance runs one engine" in text
    resolve(load_config(splitwise={"role": "prefill"}, parallel={"data_parallel_size": "auto"}, **PD))  # "auto": 1


def test_a_zmq_address_peers_cannot_reach_is_refused():
    text = _problems(splitwise={"role": "prefill"}, scheduler={"name": "splitwise"},
                     connector={"name": "zmq", "options": {"host": "0.0.0.0"}})
    assert "connector.options.advertise_host: required when host is '0.0.0.0'" in text
    resolve(load_config(splitwise={"role": "prefill"}, scheduler={"name": "splitwise"},
                        connector={"name": "zmq", "options": {"host": "0.0.0.0", "advertise_host": "10.0.0.2"}}))


def test_the_stall_timeout_must_cover_two_heartbeats():
    with pytest.raises(ConfigError, match="splitwise: .*stall_timeout_s .* must be at least 2 x heartbeat_s"):
        load_config(splitwise={"heartbeat_s": 1.0, "stall_timeout_s": 1.5})


def test_the_offline_engine_refuses_a_split_role(tmp_path):
    from fd_core.engine.llm import LLM

    with pytest.raises(ConfigError, match="splitwise.role: 'decode': an in-process engine computes whole requests"):
        LLM(config=load_config(splitwise={"role": "decode"}, **PD))
