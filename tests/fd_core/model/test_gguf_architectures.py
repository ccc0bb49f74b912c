"""GGUF files of each architecture, written from a tiny Hugging Face checkpoint as llama.cpp's converter
writes them, load through the normal loader and decode as fd-engine's load of that checkpoint does
(which the architecture kit checks against transformers): the same greedy tokens, the same logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.model.gguf_loader import load_gguf
from fd_core.model.kernels import PORTABLE_KERNELS
from fd_core.model.loader import load_model
from fd_core.testing.conformance.architecture import greedy_decode
from fd_core.testing.tiny_model import make_tiny_checkpoint, write_tiny_gguf
from fd_plugins.models.llama import LlamaFamily

TINY = LlamaFamily().tiny_hf_configs()


def _config(case: str, **changes: object) -> dict:
    """The plugin's tiny config ``case`` with a vocabulary the tiny tokenizer fills, and ``changes``."""
    return {**TINY[case], "vocab_size": 512, **changes}


#: Case -> (the GGUF architecture, the checkpoint's config): the plugin's tiny configs, changed only
#: where llama.cpp fixes what its files leave out.
CASES = {
    # llama.cpp: every Qwen3-MoE layer has experts, their weights renormalised
    "qwen3moe": ("qwen3moe", _config("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[])),
    # llama.cpp: every sixth Gemma 3 layer is global, queries scaled by head_dim
    "gemma3": ("gemma3", _config("gemma3", num_hidden_layers=7, sliding_window_pattern=6)),
    "gemma3_softcap": ("gemma3", _config("gemma3_softcap", num_hidden_layers=7, query_pre_attn_scalar=32,
                                         layer_types=[*["sliding_attention"] * 5, "full_attention",
                                                      "sliding_attention"])),
    "phi3": ("phi3", _config("phi3_partial_longrope")),
    "phi3_window": ("phi3", _config("phi3_partial_longrope", rope_scaling=None, sliding_window=12)),
    "granite": ("granite", _config("granite")),
    # llama.cpp: every fourth SmolLM3 layer has no RoPE
    "smollm3": ("smollm3", _config("smollm3", no_rope_layer_interval=4)),
    "ernie4_5": ("ernie4_5", _config("ernie4_5")),
    # the converter sizes the shared experts intermediate_size / num_key_value_heads (2 x 32 here)
    "ernie4_5_moe": ("ernie4_5-moe", _config("ernie4_5_moe", intermediate_size=128)),
    "qwen3_yarn": ("qwen3", _config("qwen3_bias_yarn")),
    "llama_bias": ("llama", _config("llama_attention_bias")),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140))]
NEW_TOKENS = 8


def _converted(tmp_path: Path, case: str, **options: object) -> tuple[Path, Path]:
    """The tiny checkpoint of ``case`` and the GGUF file written from it."""
    folder = make_tiny_checkpoint(tmp_path / case, CASES[case][1], seed=3)
    return folder, write_tiny_gguf(tmp_path / f"{case}.gguf", folder, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_a_converted_gguf_decodes_as_its_checkpoint(tmp_path: Path, case: str) -> None:
    import gguf

    folder, path = _converted(tmp_path, case)
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == CASES[case][0]
    decoded = []
    for model in (load_model(str(folder)), load_model(str(path))):
        decoded.append(greedy_decode(model.architecture, model.arch, model.weights, PROMPTS, NEW_TOKENS,
                                     kernels=PORTABLE_KERNELS))
    (want, want_logits), (got, got_logits) = decoded
    assert got == want
    for ours, theirs in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("case", ["phi3", "ernie4_5_moe"])
def test_kept_blocks_of_fused_and_merged_tensors_are_the_float32_weights(tmp_path: Path, case: str) -> None:
    """Phi-3's fused q/k/v and gate/up split in their blocks; each expert of a 3-D tensor kept; routers float32."""
    from fd_kernels.quantized import BlockQuantized

    _, path = _converted(tmp_path, case, tensor_type="Q8_0")
    _, dense, _ = load_gguf(path)
    _, kept, _ = load_gguf(path, keep_quantized=True)
    assert kept.keys() == dense.keys()
    for name, value in dense.items():
        matrix = value.ndim == 2 and not name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        assert isinstance(kept[name], BlockQuantized) == matrix, name
        np.testing.assert_array_equal(kept[name].dequantize() if matrix else kept[name], value, err_msg=name)


def test_every_key_of_a_new_architecture_is_read_or_refused_by_name(tmp_path: Path) -> None:
    import gguf

    _, path = _converted(tmp_path, "gemma3")
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    LlamaFamily().parse_gguf(metadata, shapes)
    # attn_logit_softcapping: Gemma 2's; the pattern: llama.cpp fixes Gemma 3's, another would be another model
    for key in ("gemma3.attn_logit_softcapping", "gemma3.attention.sliding_window_pattern", "gemma3.expert_count",
                "gemma3.fd_unknown_key"):
        with pytest.raises(ArchitectureConfigError) as info:
            LlamaFamily().parse_gguf({**metadata, key: 1}, shapes)
        assert info.value.key == key


@pytest.mark.parametrize(("case", "changes", "lost"), [
    ("qwen3_moe", {}, "dense layers"),
    ("qwen3_moe", {"mlp_only_layers": []}, "norm_topk_prob false"),
    ("gemma3", {}, "sliding layers"),
    ("smollm3", {}, "layers without RoPE"),
])
def test_a_model_the_file_cannot_hold_is_not_written(tmp_path: Path, case: str, changes: dict, lost: str) -> None:
    folder = make_tiny_checkpoint(tmp_path / case, _config(case, **changes))
    with pytest.raises(ValueError, match=lost):
        write_tiny_gguf(tmp_path / "lossy.gguf", folder)
