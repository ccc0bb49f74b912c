"""The ``zmq`` connector across two hosts: prefill and decode in two network namespaces joined by
a veth pair (made here with ``ip netns``; root needed), so the KV can only travel over that link.

    ns P (10.213.0.1) ==== veth ==== ns D (10.213.0.2)        the cluster link: zmq KV transfer
       | 10.214.1.2                     | 10.214.2.2
    root 10.214.1.1                root 10.214.2.1            the test's HTTP and Redis links

The root namespace does not forward between its two links, so P and D reach each other only
over the cluster link.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fd_core.request import SamplingParams
from fd_core.testing.redis_server import RedisServer, redis_server_path
from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess
from tests.fd_core.server.test_pool import PROMPTS, _wait_for
from tests.fd_core.server.test_requests import metric, metrics

MAX_TOKENS = 16


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Two network namespaces (``p``, ``d``) joined by a veth pair, each also linked to the root."""

    CLUSTER = {"p": "10.213.0.1", "d": "10.213.0.2"}
    OUTSIDE = {"p": ("10.214.1.1", "10.214.1.2"), "d": ("10.214.2.1", "10.214.2.2")}   # (root side, ns side)

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {"p": f"fdp-{tag}", "d": f"fdd-{tag}"}
        self._made: list[str] = []
        self._root_links: list[str] = []
        try:
            self._make(tag)
        except BaseException:
            self.remove()
            raise

    def _make(self, tag: str) -> None:
        for ns in self.ns.values():
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"fdc-{tag}", "netns", self.ns["p"], "type", "veth", "peer", "name", f"fdc2-{tag}",
            "netns", self.ns["d"])
        for side, link in (("p", f"fdc-{tag}"), ("d", f"fdc2-{tag}")):
            _ip("-n", self.ns[side], "addr", "add", f"{self.CLUSTER[side]}/24", "dev", link)
            _ip("-n", self.ns[side], "link", "set", link, "up")
        for side in ("p", "d"):
            root_addr, ns_addr = self.OUTSIDE[side]
            outer, inner = f"fdo{side}-{tag}", f"fdi{side}-{tag}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", self.ns[side])
            self._root_links.append(outer)
            _ip("addr", "add", f"{root_addr}/24", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("-n", self.ns[side], "addr", "add", f"{ns_addr}/24", "dev", inner)
            _ip("-n", self.ns[side], "link", "set", inner, "up")

    def remove(self) -> None:
        for link in self._root_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fdprobe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    made = Hosts()
    yield made
    made.remove()


class NamespacedServer(ServerProcess):
    """An fd-serve started inside a network namespace, its front end on that namespace's outside address."""

    def __init__(self, ns: str, host: str, args: list[str], log_path: Path) -> None:
        self._ns = ns
        super().__init__(["--server.host", host, *args], log_path)
        self.url = f"http://{host}:{self.port}"

    def _command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._ns, sys.executable, "-m", "fd_core.cli", *args]


def test_zmq_carries_the_kv_between_two_hosts(tiny_model, hosts, tmp_path):
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = RedisServer(tmp_path / "redis", bind=(hosts.OUTSIDE["p"][0], hosts.OUTSIDE["d"][0])).start()
    servers = []
    try:
        for side in ("p", "d"):
            role = {"p": "prefill", "d": "decode"}[side]
            options = (f'{{"url": "{redis.url_at(hosts.OUTSIDE[side][0])}", "topic": "netns", '
                       '"heartbeat_s": 0.2, "lease_s": 1.0}')
            server = NamespacedServer(hosts.ns[side], hosts.OUTSIDE[side][1], [
                "--model.source", str(tiny_model), *TINY_ARGS, "--splitwise.role", role,
                "--scheduler.name", "splitwise", "--scheduler.options", options, "--connector.name", "zmq",
                "--connector.options", f'{{"host": "{hosts.CLUSTER[side]}"}}'], tmp_path / f"{role}.log")
            servers.append(server)
            server.wait_ready()
        prefill, decode = servers
        from fd_core.engine.llm import LLM

        want = [r.text for r in LLM(str(tiny_model), cache={"num_blocks": 256}).generate(
            PROMPTS[:4], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
        got = [httpx.post(decode.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for prompt in PROMPTS[:4]]
        assert got == want
        on_prefill = metrics(prefill.url)
        assert metric(on_prefill, "fd_splitwise_jobs_done_total") == 4
        assert metric(on_prefill, "fd_splitwise_connector_bytes_sent_total") > 0
        for server in servers:
            _wait_for(lambda s=server: metric(t := metrics(s.url), "fd_kv_cache_blocks_free")
                      == metric(t, "fd_kv_cache_blocks_total") > 0, "every block free")
        # the prefill instance published its cluster address, which only the veth pair reaches
        assert f"tcp://{hosts.CLUSTER['p']}:" in prefill.log()
    finally:
        for server in servers:
            server.stop()
        redis.stop()
