"""Fixtures of the conformance kit's tests: the broken plugin package (importable, and installed
into a folder of its own for ``fd-serve plugins check``), and one tiny model for the hand-offs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BROKEN_PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "fd_broken_plugins"


@pytest.fixture(scope="session")
def broken_plugins():
    """The ``fd_broken_plugins`` package, imported from its source folder.

    Only its modules become importable here: no distribution metadata is added to this process,
    so other tests never discover the broken plugins (its platform's detector raises).
    """
    source = str(BROKEN_PACKAGE / "src")
    sys.path.insert(0, source)
    try:
        import fd_broken_plugins.connector
        import fd_broken_plugins.guided_decoding
        import fd_broken_plugins.platform
        import fd_broken_plugins.proposer
        import fd_broken_plugins.resource_manager
        import fd_broken_plugins.scheduler
        import fd_broken_plugins.token_processor

        yield fd_broken_plugins
    finally:
        sys.path.remove(source)


@pytest.fixture(scope="session")
def broken_plugins_site(tmp_path_factory) -> Path:
    """A folder with ``fd-broken-plugins`` pip-installed into it (``--target``), for a subprocess's
    PYTHONPATH: installing it into the shared environment would make every other test running
    meanwhile discover a platform whose detector raises."""
    work = tmp_path_factory.mktemp("fd-broken-plugins")
    package = shutil.copytree(BROKEN_PACKAGE, work / "package",
                              ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", "install", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(package)],
                   check=True, capture_output=True, text=True)
    return site


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from fd_core.testing.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, vocab=512,
                               max_position_embeddings=512))
