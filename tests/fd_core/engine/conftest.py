"""A tiny random Llama folder shared by the engine tests, and an LLM factory over it."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.engine.llm import LLM
from fd_core.testing.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, vocab=512,
                               max_position_embeddings=512))


@pytest.fixture
def make_llm(tiny_model_dir):
    """Build an LLM over the tiny model; keyword arguments are config sections."""

    def factory(**sections):
        sections.setdefault("cache", {})
        sections["cache"].setdefault("num_blocks", 256)
        sections.setdefault("model", {})
        sections["model"].setdefault("source", tiny_model_dir)
        return LLM(config=load_config(**sections))

    return factory
