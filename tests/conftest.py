"""Shared fixtures: the pip-installed demo plugin packages and a subprocess fd-serve runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_PACKAGES = Path(__file__).parent / "plugins"


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
