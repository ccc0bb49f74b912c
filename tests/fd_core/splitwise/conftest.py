"""A tiny random Llama folder shared by the hand-off tests."""

from __future__ import annotations

import pytest

from fd_core.testing.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, vocab=512,
                               max_position_embeddings=512))
