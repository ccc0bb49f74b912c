"""The built-in Llama-family plugin passes the architecture conformance kit: greedy tokens equal
transformers' on tiny random Llama (plain, llama3 / linear / dynamic / yarn RoPE, o_proj bias),
Mistral, Qwen2, Qwen3 (q/k norms, explicit head_dim, biases), Granite, SmolLM3, Phi-3 (partial
rotary, longrope), ERNIE 4.5 and the MoE models, with the portable kernels and with the host's,
and the bf16 mode keeps transformers' top-1 token; GGUF metadata is parsed or refused by key."""

from __future__ import annotations

import pytest

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.testing.conformance import check_architecture, run_architecture_checks
from fd_plugins.models.llama import LlamaFamily


def test_the_config_checks_pass() -> None:
    report = run_architecture_checks(LlamaFamily, skip=("matches_transformers", "bf16_agreement"))
    assert [r.status for r in report.results] == ["passed", "passed", "skipped", "skipped"]


@pytest.mark.hf
@pytest.mark.slow
def test_greedy_tokens_match_transformers_on_every_tiny_config() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    check_architecture(LlamaFamily)


GGUF_METADATA = {"general.architecture": "llama", "llama.context_length": 512, "llama.embedding_length": 64,
                 "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
                 "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
                 "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0}
GGUF_SHAPES = {"token_embd.weight": (64, 160), "output.weight": (64, 160)}


def test_gguf_metadata_parses_into_the_shape() -> None:
    arch = LlamaFamily().parse_gguf(GGUF_METADATA, GGUF_SHAPES)
    assert (arch.vocab_size, arch.hidden_size, arch.head_dim, arch.num_key_value_heads, arch.tie_word_embeddings) == (
        160, 64, 16, 2, False)


@pytest.mark.parametrize(("change", "key"), [
    ({"llama.attention.sliding_window": 64}, "llama.attention.sliding_window"),
    ({"llama.expert_count": 8}, "llama.expert_count"),
    ({"llama.rope.dimension_count": 8}, "llama.rope.dimension_count"),
    ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type"),
    ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.factor"),
    ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.factor"),
    ({"llama.rope.scaling.factor": 2.0}, "llama.rope.scaling.factor"),
    ({"llama.rope.scaling.attn_factor": 1.2}, "llama.rope.scaling.attn_factor"),
    ({"llama.attention.scale": 0.1}, "llama.attention.scale"),
])
def test_a_gguf_key_the_plugin_cannot_serve_is_refused_by_name(change: dict, key: str) -> None:
    with pytest.raises(ArchitectureConfigError) as info:
        LlamaFamily().parse_gguf({**GGUF_METADATA, **change}, GGUF_SHAPES)
    assert info.value.key == key
