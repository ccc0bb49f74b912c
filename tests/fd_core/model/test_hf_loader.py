"""Hugging Face folder loading: weights round-trip exactly (float32, bfloat16, sharded, tied)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ModelLoadError
from fd_core.model.hf_loader import load_hf_folder, read_hf_config
from fd_core.testing.tiny_model import make_tiny_llama, round_to_bfloat16, tiny_llama_weights


def test_float32_weights_round_trip(tiny_folder: Path) -> None:
    arch, weights = load_hf_folder(tiny_folder)
    expected = tiny_llama_weights(arch, seed=0)
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_config_fields(tiny_folder: Path) -> None:
    arch = read_hf_config(tiny_folder)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert (arch.head_dim, arch.vocab_size, arch.intermediate_size) == (16, 512, 128)
    assert arch.eos_token_ids == (2,) and arch.bos_token_id == 1
    assert not arch.tie_word_embeddings


def test_bfloat16_weights_load_as_rounded_float32(tmp_path: Path, tiny_folder: Path) -> None:
    folder = make_tiny_llama(tmp_path / "bf16", dtype="bfloat16")
    _, weights = load_hf_folder(folder)
    _, f32 = load_hf_folder(tiny_folder)
    for name, value in f32.items():
        got = weights[name]
        assert got.dtype == np.float32
        assert not np.any(got.view(np.uint32) & 0xFFFF), f"{name}: low 16 bits must be zero"
        np.testing.assert_array_equal(got.view(np.uint32) >> 16, round_to_bfloat16(value), err_msg=name)
        np.testing.assert_allclose(got, value, rtol=2**-8, atol=0, err_msg=name)


@pytest.mark.hf
def test_bfloat16_matches_torch_reader(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    folder = make_tiny_llama(tmp_path / "bf16", dtype="bfloat16")
    _, weights = load_hf_folder(folder)
    reference = load_file(str(folder / "model.safetensors"))
    for name, tensor in reference.items():
        np.testing.assert_array_equal(weights[name], tensor.float().numpy(), err_msg=name)


@pytest.mark.hf
def test_transformers_reads_the_same_weights(tiny_folder: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_folder))
    _, weights = load_hf_folder(tiny_folder)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert state.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_sharded_folder_equals_single_file(tmp_path: Path, tiny_folder: Path) -> None:
    folder = make_tiny_llama(tmp_path / "sharded", shards=3)
    assert len(list(folder.glob("model-*-of-00003.safetensors"))) == 3
    _, sharded = load_hf_folder(folder)
    _, single = load_hf_folder(tiny_folder)
    assert sharded.keys() == single.keys()
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name])


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "sharded", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors"):
        load_hf_folder(folder)


def test_tied_model_has_no_lm_head(tmp_path: Path) -> None:
    arch, weights = load_hf_folder(make_tiny_llama(tmp_path / "tied", tie=True))
    assert arch.tie_word_embeddings
    assert "lm_head.weight" not in weights


def _with_config(tmp_path: Path, **changes: object) -> Path:
    folder = make_tiny_llama(tmp_path / "changed")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("changes", "refused"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling\.high_freq_factor: .*needs it"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, r"rope_scaling\.rope_type: 'su' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 4}},
     r"rope_parameters\.beta_fast: is not a setting of rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.6}},
     r"partial_rotary_factor: rotates 9 of 16 dimensions"),
    ({"quantization_config": {"quant_method": "awq"}}, r"quantization_config: is not a key"),
    ({"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported"),
    ({"mlp_bias": True}, r"mlp_bias: True is not supported"),
    ({"model_type": "qwen2"}, r"model_type: 'qwen2' does not match architecture 'LlamaForCausalLM'"),
])
def test_a_config_key_the_plugin_cannot_serve_is_refused_by_name(tmp_path: Path, changes: dict,
                                                                 refused: str) -> None:
    with pytest.raises(ModelLoadError, match=refused):
        read_hf_config(_with_config(tmp_path, **changes))


def test_an_architecture_no_plugin_declares_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"architecture 'GPT2LMHeadModel' is not supported; supported: .*"
                                             r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        read_hf_config(_with_config(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_sliding_windows_go_to_the_layers_transformers_gives_them(tmp_path: Path) -> None:
    mistral = read_hf_config(_with_config(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral",
                                          max_position_embeddings=512, sliding_window=96))
    assert (mistral.max_position_embeddings, mistral.sliding_window, mistral.sliding_layers) == (512, 96, (0, 1))
    qwen_off = read_hf_config(_with_config(tmp_path / "q", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                           max_position_embeddings=512, sliding_window=96, use_sliding_window=False))
    assert (qwen_off.sliding_window, qwen_off.sliding_layers) == (None, ())
    qwen_on = read_hf_config(_with_config(tmp_path / "r", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                          sliding_window=96, use_sliding_window=True, max_window_layers=1))
    assert qwen_on.sliding_layers == (1,)
    wide = read_hf_config(_with_config(tmp_path / "w", architectures=["MistralForCausalLM"], model_type="mistral",
                                       max_position_embeddings=512, sliding_window=4096))
    assert wide.sliding_layers == ()   # a window as long as the context: full attention, the fused kernel


def test_yarn_serves_the_stretched_window(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, max_position_embeddings=256,
                          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    arch = read_hf_config(folder)
    assert (arch.rope_type, arch.max_position_embeddings) == ("yarn", 1024)


def test_truncated_safetensors_is_reported(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "broken")
    (folder / "model.safetensors").write_bytes(b"\x00")
    with pytest.raises(ModelLoadError, match=r"not a safetensors file"):
        load_hf_folder(folder)
