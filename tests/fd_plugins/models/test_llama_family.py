"""The built-in Llama-family plugin passes the architecture conformance kit: greedy tokens equal
transformers' on tiny random Llama (plain, llama3 / linear / dynamic / yarn RoPE, o_proj bias),
Mistral, Qwen2 and Qwen3 (q/k norms, explicit head_dim, biases) models, with the portable kernels
and with the host's."""

from __future__ import annotations

import pytest

from fd_core.testing.conformance import check_architecture, run_architecture_checks
from fd_plugins.models.llama import LlamaFamily


def test_the_config_checks_pass() -> None:
    report = run_architecture_checks(LlamaFamily, skip=("matches_transformers",))
    assert [r.status for r in report.results] == ["passed", "passed", "skipped"]


@pytest.mark.hf
@pytest.mark.slow
def test_greedy_tokens_match_transformers_on_every_tiny_config() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    check_architecture(LlamaFamily)
