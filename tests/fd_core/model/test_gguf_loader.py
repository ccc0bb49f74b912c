"""GGUF loading: dequantization, Hugging Face names, and llama.cpp's Q/K permutation undone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ModelLoadError
from fd_core.model.arch import LlamaArchConfig
from fd_core.model.gguf_loader import KEPT_TENSOR_TYPES, load_gguf, supported_tensor_types
from fd_core.model.hf_loader import load_hf_folder
from fd_core.testing.tiny_model import make_tiny_llama, write_tiny_gguf
from tests.fd_core.model.gguf_encoders import write_gguf

#: Type -> bounds of its error against the float weights (max error / max |w|, mean error /
#: mean |w|, per matrix): about 1.4 times what this file's encoders give, so a layout mistake
#: (an error as large as the weights) fails.
QUANT_ERRORS = {
    "Q2_K": (0.4, 0.45), "Q3_K": (0.3, 0.22), "Q4_K": (0.08, 0.12), "Q5_K": (0.04, 0.06),
    "Q6_K": (0.03, 0.03), "Q5_0": (0.07, 0.07), "Q5_1": (0.04, 0.06), "IQ4_NL": (0.12, 0.12),
    "IQ4_XS": (0.13, 0.12), "BF16": (2**-8, 0.003), "MXFP4": (0.33, 0.15),
}
_GGUF_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_PARTS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose matrices all have rows of 256 values, one K-quant block (4 heads of 64)."""
    return make_tiny_llama(tmp_path_factory.mktemp("wide") / "wide-llama", hidden=256, intermediate=256)


def _stored(path: Path, arch: LlamaArchConfig) -> dict[str, tuple[str, np.ndarray]]:
    """HF name -> (GGUF type, ``gguf.quants.dequantize`` of the stored bytes, Q/K rows un-permuted)."""
    import gguf

    stored = {}
    for tensor in gguf.GGUFReader(path).tensors:
        stem, kind = tensor.name.rsplit(".", 1)
        if stem in _GGUF_GLOBALS:
            name = f"{_GGUF_GLOBALS[stem]}.{kind}"
        else:
            _, layer, part = stem.split(".")
            name = f"model.layers.{layer}.{_GGUF_PARTS[part]}.{kind}"
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj." in name or ".k_proj." in name:  # llama.cpp: per head, pairs -> two halves
            heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
            rows, cols = value.shape
            value = value.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        stored[name] = (tensor.tensor_type.name, value)
    return stored


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


def test_every_type_gguf_py_dequantizes_is_supported() -> None:
    import gguf

    supported = supported_tensor_types()
    assert {"F32", "F16", "BF16", *KEPT_TENSOR_TYPES, *QUANT_ERRORS} <= set(supported)
    for qtype in gguf.GGMLQuantizationType:
        if qtype.name not in supported:
            with pytest.raises(NotImplementedError):
                gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)


@pytest.mark.parametrize("tensor_type", list(QUANT_ERRORS))
def test_quantized_type_loads_as_gguf_py_dequantizes_it(tmp_path: Path, wide_folder: Path,
                                                        tensor_type: str) -> None:
    """Matrices are gguf-py's float32 values of the stored bytes, Q/K un-permuted; norms stay F32."""
    hf_arch, original = load_hf_folder(wide_folder)
    path = write_gguf(tmp_path / "q.gguf", wide_folder, tensor_type=tensor_type)
    arch, weights, _ = load_gguf(path)
    stored = _stored(path, arch)
    max_error, mean_error = QUANT_ERRORS[tensor_type]
    assert weights.keys() == stored.keys() == original.keys()
    for name, value in original.items():
        assert weights[name].dtype == np.float32, name
        np.testing.assert_array_equal(weights[name], stored[name][1], err_msg=name)
        if value.ndim == 1:
            assert stored[name][0] == "F32", name
            np.testing.assert_array_equal(weights[name], value, err_msg=name)
            continue
        assert stored[name][0] == tensor_type, name
        error = np.abs(weights[name] - value)
        assert 0 < error.max() <= max_error * np.abs(value).max(), name
        assert error.mean() <= mean_error * np.abs(value).mean(), name


def test_q4_0_file_with_a_q6_k_head_keeps_every_matrix_in_blocks(tmp_path: Path, wide_folder: Path) -> None:
    """What llama.cpp writes as Q4_0: the Q4_0 matrices and the Q6_K head stay blocks, of the
    same values as the float32 load; an IQ4_NL matrix (not kept) is float32 either way."""
    from fd_kernels.quantized import BlockQuantized

    path = write_gguf(tmp_path / "q4_0.gguf", wide_folder, tensor_type="Q4_0",
                      tensor_types={"output.weight": "Q6_K", "blk.1.ffn_up.weight": "IQ4_NL"})
    _, dense, _ = load_gguf(path)
    _, kept, _ = load_gguf(path, keep_quantized=True)
    assert isinstance(kept["model.layers.1.mlp.up_proj.weight"], np.ndarray)
    blocks = [name for name, value in kept.items() if isinstance(value, BlockQuantized)]
    assert blocks == [name for name, value in dense.items()
                      if value.ndim == 2 and name != "model.layers.1.mlp.up_proj.weight"]
    assert kept["lm_head.weight"].group == 16   # Q6_K: a scale per 16
    for name in blocks:
        np.testing.assert_array_equal(kept[name].dequantize(), dense[name], err_msg=name)


def test_type_gguf_py_cannot_dequantize_is_refused_naming_the_tensor(tmp_path: Path, wide_folder: Path) -> None:
    import gguf

    supported = supported_tensor_types()
    unsupported = [t for t in gguf.GGMLQuantizationType if t.name not in supported]
    if not unsupported:
        pytest.skip("this gguf-py dequantizes every GGML type")
    qtype = unsupported[0]
    quantize = gguf.quants.quantize

    def fake_quantize(data: np.ndarray, to: gguf.GGMLQuantizationType) -> np.ndarray:
        if to != qtype:
            return quantize(data, to)
        return np.zeros(gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), np.uint8)  # any bytes

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", fake_quantize)
        path = write_tiny_gguf(tmp_path / "odd.gguf", wide_folder, tensor_types={"blk.1.ffn_down.weight": qtype.name})
    with pytest.raises(ModelLoadError, match=rf"'blk\.1\.ffn_down\.weight' has type {qtype.name}, which is not "
                                             "supported") as info:
        load_gguf(path)
    assert f"supported types: {', '.join(supported)}" in str(info.value)


def test_q4_k_m_file_decodes_as_its_float32_weights(tmp_path: Path, wide_folder: Path) -> None:
    """A Q4_K_M-style file (Q4_K matrices, Q6_K head and ffn_down) runs through ``load_model`` and
    greedy-decodes the tokens of a float32 folder holding gguf-py's values of its bytes."""
    import shutil

    from safetensors.numpy import save_file

    from fd_core.engine.llm import LLM
    from fd_core.request import SamplingParams

    path = write_gguf(tmp_path / "q4_k_m.gguf", wide_folder, tensor_type="Q4_K",
                      tensor_types={"output.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
                                    "blk.1.ffn_down.weight": "Q6_K"})
    folder = shutil.copytree(wide_folder, tmp_path / "float32", ignore=shutil.ignore_patterns("*.safetensors"))
    arch, _ = load_hf_folder(wide_folder)
    save_file({name: value for name, (_, value) in _stored(path, arch).items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    prompts = [[5, 6, 7, 8] * 5, list(range(100, 130))]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = []
    for source in (path, folder):
        # plain Paddle kernels: no C++ build for a test of what the loader hands the model
        with LLM(source, cache={"num_blocks": 16}, platform={"name": "cpu", "options": {"kernels": "portable"}}) as llm:
            answers.append([output.token_ids for output in llm.generate(prompts, greedy, use_tqdm=False)])
    assert answers[0] == answers[1]
    assert all(len(set(tokens)) > 4 for tokens in answers[0])  # real continuations, not one token repeated


QWEN_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False}


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("config", [
    {**QWEN_BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
    {**QWEN_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    {**QWEN_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": LLAMA3_ROPE},
    {**QWEN_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
     "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
], ids=["qwen2", "qwen3", "llama3-rope-freqs", "linear-rope"])
def test_a_gguf_loads_the_folders_weights_and_decodes_what_the_folder_does(tmp_path: Path, config: dict) -> None:
    """Also RoPE scaling as llama.cpp's converter writes it: Llama 3.1's per-frequency factors as a
    rope_freqs tensor, linear as metadata."""
    from fd_core.engine.llm import LLM
    from fd_core.request import SamplingParams
    from fd_core.testing.tiny_model import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "hf", config, seed=4)
    path = write_tiny_gguf(tmp_path / "model.gguf", folder)
    arch, weights, metadata = load_gguf(path)
    folder_arch, folder_weights = load_hf_folder(folder)
    assert metadata["general.architecture"] == config["model_type"]
    assert (arch.architecture, arch.head_dim, arch.attention_bias, arch.qk_norm) == (
        folder_arch.architecture, folder_arch.head_dim, folder_arch.attention_bias, folder_arch.qk_norm)
    assert weights.keys() - {"model.rope_freqs.weight"} == folder_weights.keys()
    for name, value in folder_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France", "1 2 3 4"]
    outputs = []
    for source in (folder, path):
        with LLM(model=str(source), cache={"num_blocks": 64}, platform={"options": {"kernels": "portable"}}) as llm:
            outputs.append([r.token_ids for r in llm.generate(prompts, greedy)])
    assert outputs[0] == outputs[1]
