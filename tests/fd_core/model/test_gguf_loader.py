"""GGUF loading: dequantization, Hugging Face names, and llama.cpp's Q/K permutation undone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ModelLoadError
from fd_core.model.gguf_loader import load_gguf
from fd_core.model.hf_loader import load_hf_folder
from fd_core.testing.tiny_model import make_tiny_llama, write_tiny_gguf


def test_f32_gguf_equals_hf_weights(tmp_path: Path, tiny_folder: Path) -> None:
    hf_arch, hf_weights = load_hf_folder(tiny_folder)
    arch, weights, metadata = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_folder))
    assert weights.keys() == hf_weights.keys()
    for name, value in hf_weights.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    # same shape of model; EOS differs on purpose (GGUF adds llama.cpp's end-of-generation tokens)
    assert arch.eos_token_ids[0] == 2
    assert dataclasses.replace(arch, eos_token_ids=()) == dataclasses.replace(hf_arch, eos_token_ids=())
    assert metadata["tokenizer.ggml.model"] == "gpt2"


def test_q_and_k_are_stored_permuted(tmp_path: Path, tiny_folder: Path) -> None:
    """The file really holds permuted rows, so the equality above proves the un-permute."""
    import gguf

    _, hf_weights = load_hf_folder(tiny_folder)
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_folder))
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    for gguf_name, hf_name in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        stored = raw[f"blk.0.{gguf_name}.weight"]
        original = hf_weights[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert stored.shape == original.shape
        assert not np.array_equal(stored, original)
        assert sorted(map(tuple, stored)) == sorted(map(tuple, original))  # same rows, other order


@pytest.mark.parametrize(
    ("tensor_type", "tolerance"), [("F16", 1e-3), ("Q8_0", 1 / 100), ("Q4_1", 1 / 7), ("Q4_0", 1 / 7)]
)
def test_quantized_gguf_is_close(
    tmp_path: Path, tiny_folder: Path, tensor_type: str, tolerance: float
) -> None:
    _, hf_weights = load_hf_folder(tiny_folder)
    _, weights, _ = load_gguf(write_tiny_gguf(tmp_path / "q.gguf", tiny_folder, tensor_type=tensor_type))
    for name, value in hf_weights.items():
        error = np.abs(weights[name] - value)
        assert error.max() <= tolerance * np.abs(value).max(), name
        if value.ndim == 2:
            assert error.max() > 0, f"{name} should be {tensor_type}, not exact"
            # quantization error is unbiased noise; a layout mistake would be as large as the values
            assert error.mean() < 0.25 * np.abs(value).mean(), name
        else:
            np.testing.assert_array_equal(weights[name], value, err_msg=f"{name} stays F32")


def test_tied_gguf(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "tied", tie=True)
    arch, weights, _ = load_gguf(write_tiny_gguf(tmp_path / "tied.gguf", folder))
    assert arch.tie_word_embeddings
    assert "lm_head.weight" not in weights


def test_metadata_becomes_arch_config(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m", hidden=96, heads=6, kv_heads=3, layers=3, rope_theta=50000.0)
    arch, _, _ = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", folder))
    assert (arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (
        96,
        6,
        3,
        16,
    )
    assert (arch.num_hidden_layers, arch.rope_theta, arch.rms_norm_eps) == (3, 50000.0, 1e-5)
    assert (arch.vocab_size, arch.max_position_embeddings, arch.bos_token_id) == (512, 512, 1)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path, tiny_folder: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q5.gguf", tiny_folder, tensor_types={"blk.1.ffn_down.weight": "Q5_0"})
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_down\.weight' has type Q5_0") as info:
        load_gguf(path)
    assert "Q4_1" in str(info.value)  # lists what is supported


def test_non_llama_gguf_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported"):
        load_gguf(path)


@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q4_0", "Q8_0"])
def test_kept_blocks_dequantize_to_the_loaders_float32_weights(tmp_path: Path, tiny_folder: Path,
                                                                tensor_type: str) -> None:
    """Kept blocks are the same values (q/k rows un-permuted too); 1-D tensors stay float32."""
    from fd_kernels.quantized import BlockQuantized

    path = write_tiny_gguf(tmp_path / "q.gguf", tiny_folder, tensor_type=tensor_type)
    _, dense, _ = load_gguf(path)
    _, kept, _ = load_gguf(path, keep_quantized=True)
    assert kept.keys() == dense.keys()
    for name, value in dense.items():
        if value.ndim == 2:
            assert isinstance(kept[name], BlockQuantized), name
            assert kept[name].shape == value.shape and kept[name].nbytes < value.nbytes / 3
            np.testing.assert_array_equal(kept[name].dequantize(), value, err_msg=name)
        else:
            assert isinstance(kept[name], np.ndarray)
            np.testing.assert_array_equal(kept[name], value, err_msg=name)
