"""The example plugin packages under examples/, pip-installed for real, and a tiny model to run them on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fd_core.testing.tiny_model import make_tiny_llama

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def priority_plugin() -> Path:
    """Install examples/priority-scheduler as a user would (pip, not editable), remove it afterwards.

    The same policy as the root conftest's ``demo_plugins``. The plugin defers to the built-in
    decisions while all priorities are equal, so other tests of the session are unaffected.
    """
    package = EXAMPLES / "priority-scheduler"
    _pip("install", "--no-deps", "--no-build-isolation", str(package))
    yield package
    _pip("uninstall", "-y", "fd-priority-scheduler")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", layers=2, vocab=512,
                           max_position_embeddings=512)
