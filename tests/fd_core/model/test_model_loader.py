"""load_model dispatch and its errors: missing paths, unsupported architectures, bad weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ModelLoadError
from fd_core.model.loader import LoadedModel, load_model
from fd_core.testing.tiny_model import make_tiny_llama, tiny_llama_weights, write_tiny_gguf


def test_folder_and_gguf_load_the_same_model(tiny_folder: Path, tmp_path: Path) -> None:
    from_folder = load_model(str(tiny_folder))
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_folder)
    from_gguf = load_model(str(gguf_path))
    assert isinstance(from_folder, LoadedModel)
    assert from_folder.source_path == tiny_folder and from_gguf.source_path == gguf_path
    for name, value in tiny_llama_weights(from_folder.arch).items():
        np.testing.assert_array_equal(from_gguf.weights[name], value)
        np.testing.assert_array_equal(from_folder.weights[name], value)
    text = "Hello 😀 2024"
    assert from_folder.tokenizer.encode(text) == from_gguf.tokenizer.encode(text)
    assert set(from_folder.arch.eos_token_ids) <= set(from_gguf.arch.eos_token_ids)
    assert from_gguf.arch.eos_token_ids == from_gguf.tokenizer.eos_token_ids
    assert "weights=<21 tensors>" in repr(from_folder)  # no array dumps in logs


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=r"not found") as info:
        load_model(str(missing))
    assert str(missing) in str(info.value)
    assert "smollm2-135m-instruct" in str(info.value)  # suggests the alias


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"is a folder without config\.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel' is not supported") as info:
        load_model(str(folder))
    assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


def test_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "short")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model.layers.2.") as info:
        load_model(str(folder))
    assert "wrong shapes: model.layers.0.mlp.gate_proj.weight (128, 64) (expected (96, 64))" in str(
        info.value
    )


def test_other_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"neither a model folder nor a .gguf file"):
        load_model(str(path))


def test_gguf_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=r"not a readable GGUF file"):
        load_model(str(path))
