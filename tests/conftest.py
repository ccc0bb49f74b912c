"""Shared fixtures (the pip-installed demo plugin packages, a subprocess fd-serve runner), and
the host CPU check that runs first and stops the run if the model cannot run on this CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def run_fd_serve(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``fd-serve`` as a user would, in a fresh interpreter (fresh entry-point metadata)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real redis-server on a free loopback port (skipped where none is installed, except in CI)."""
    from fd_core.testing.redis_server import RedisServer, redis_server_path

    if redis_server_path() is None:
        if os.environ.get("FD_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed but FD_REQUIRE_REDIS is set (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
