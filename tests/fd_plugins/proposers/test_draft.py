"""The ``draft`` proposer: a small model guesses greedily over its own paged KV; outputs never change."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.engine.llm import LLM
from fd_core.errors import ConfigError
from fd_core.request import SamplingParams
from fd_core.testing.conformance.proposer import VOCAB_SIZE, check_proposer
from fd_core.testing.tiny_model import make_tiny_llama
from fd_plugins.proposers.draft import DraftProposer

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The served model."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, vocab=512, max_position_embeddings=512))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Another random model with the tiny model's vocabulary (a draft that often disagrees)."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("other-llama"), layers=1, vocab=512, seed=1,
                               max_position_embeddings=512))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(5, 60))).tolist() for _ in range(n)]


def _llm(target: str, draft: str | None, **options) -> LLM:
    """``target`` served, with ``draft`` (and its ``options``) guessing 4 tokens for every request (no
    per-step cap), or without speculation."""
    proposer = ({"name": "draft", "options": {"model": draft, **options}, "max_proposed_tokens_per_step": 1024}
                if draft else {"name": "none"})
    return LLM(model={"source": target}, cache={"num_blocks": 256, "enable_prefix_caching": False}, proposer=proposer)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    with _llm(tiny_model_dir, None) as llm:
        prompts = _prompts(16, seed=0)
        yield prompts, [r.token_ids for r in llm.generate(prompts, GREEDY)], llm.engine.stats().num_steps


def test_the_target_as_its_own_draft_is_always_accepted(tiny_model_dir, reference):
    prompts, expected, plain_steps = reference
    with _llm(tiny_model_dir, tiny_model_dir, num_blocks=64) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        proposer = llm.engine._speculation.proposer
        assert len(proposer._free) == 64, "every draft block is free after the drain"
    assert [r.token_ids for r in results] == expected
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    assert stats.num_steps < plain_steps / 3   # 4 proposed + 1 per step


def test_a_draft_that_disagrees_changes_nothing_and_is_asked_for_less(tiny_model_dir, other_model_dir, reference):
    prompts, expected, _ = reference
    proposed = {}
    for adaptive in (True, False):
        with _llm(tiny_model_dir, other_model_dir, adaptive=adaptive) as llm:
            results = llm.generate(prompts, GREEDY)
            stats = llm.engine.stats()
        assert [r.token_ids for r in results] == expected
        assert stats.num_accepted_tokens < stats.num_proposed_tokens / 2
        proposed[adaptive] = stats.num_proposed_tokens
    assert proposed[True] < proposed[False] / 2


def test_a_draft_pool_too_small_for_everyone_proposes_for_those_it_holds(tiny_model_dir, reference):
    prompts, expected, _ = reference
    with _llm(tiny_model_dir, tiny_model_dir, num_blocks=8) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert len(llm.engine._speculation.proposer._free) == 8
    assert [r.token_ids for r in results] == expected
    assert 0 < stats.num_proposed_tokens < 16 * (GREEDY.max_tokens - 1)


def test_a_draft_of_another_vocabulary_or_none_at_all_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    other_vocab = str(make_tiny_llama(tmp_path / "v300", layers=1, vocab=300))
    with pytest.raises(ConfigError, match=r"proposer\.options\.model.*300 tokens.*512"):
        _llm(tiny_model_dir, other_vocab)
    with pytest.raises(ConfigError, match=r"proposer\.options\.model"):
        LLM(model={"source": tiny_model_dir}, cache={"num_blocks": 64}, proposer={"name": "draft"})


def test_the_draft_proposer_passes_the_conformance_kit(tmp_path):
    draft = make_tiny_llama(tmp_path / "kit", layers=1, vocab=VOCAB_SIZE, max_position_embeddings=4096)
    check_proposer(DraftProposer, options={"model": str(draft), "num_blocks": 2048})
