"""Shared fixtures (the pip-installed demo plugin packages, a subprocess fd-serve runner), and
the host CPU check that runs first and stops the run if the model cannot run on this CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

PLUGIN_PACKAGES = Path(__file__).parent / "plugins"
#: The test that must pass before any test runs the model in this process (tests/test_host_cpu.py).
HOST_CPU_CHECK = "test_host_cpu.py::test_a_forward_pass_runs_on_this_cpu"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the host CPU check before everything else."""
    items.sort(key=lambda item: not item.nodeid.endswith(HOST_CPU_CHECK))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Stop the run when the host CPU check fails: the next model test would kill pytest silently."""
    report = yield
    if report.failed and item.nodeid.endswith(HOST_CPU_CHECK):
        item.session.shouldstop = "this CPU cannot run the model's kernels (see the failure above)"
    return report


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def demo_plugins():
    """Install the third-party test plugin packages for real (pip), remove them afterwards."""
    _pip("install", "--no-deps", "--no-build-isolation",
         str(PLUGIN_PACKAGES / "fd_demo_plugin"), str(PLUGIN_PACKAGES / "fd_other_plugins"))
    yield
    _pip("uninstall", "-y", "fd-demo-plugin", "fd-other-plugins")


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``install_plugin(name, body)``: a general plugin as a real distribution (the module ``name``
    with ``body``, and a ``.dist-info`` folder with its ``fd.plugins`` entry point) on ``sys.path``,
    found by ``importlib.metadata`` as a pip-installed one is, without pip's minutes. Give each
    test its own names: Python keeps an imported module for the life of the process."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(name: str, body: str) -> None:
        (site / f"{name}.py").write_text("import fd_core\nfd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION\n"
                                         + textwrap.dedent(body))
        dist = site / f"{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[fd.plugins]\n{name} = {name}\n")

    return install


def run_fd_serve(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``fd-serve`` as a user would, in a fresh interpreter (fresh entry-point metadata)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


@pytest.fixture
def make_redis_server(tmp_path: Path):
    """Start real redis-servers on free loopback ports (``RedisServer``'s options: ``password``,
    ``extra_args``); all stopped afterwards. Skipped where none is installed, except in CI."""
    from fd_core.testing.redis_server import RedisServer, redis_server_path

    if redis_server_path() is None:
        if os.environ.get("FD_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed but FD_REQUIRE_REDIS is set (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    started: list[RedisServer] = []

    def make(**options: Any) -> RedisServer:
        started.append(RedisServer(tmp_path / f"redis{len(started)}", **options).start())
        return started[-1]

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(make_redis_server):
    """A real redis-server on a free loopback port (see ``make_redis_server``)."""
    return make_redis_server()
