"""Weights kept in their GGUF blocks (``model.quantized_weights = "keep"``), bfloat16 weights
(``model.linear_weights``) and the fused decoder layer: same answers as the float32 path (kept
blocks) or as the op-by-op layer, every KV block free afterwards, clear refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fd_core.config import load_config
from fd_core.engine.llm import LLM
from fd_core.model.kernels import select_kernels
from fd_core.model.llama import LlamaForCausalLM, layer_runs
from fd_core.request import SamplingParams
from fd_core.testing.tiny_model import make_tiny_checkpoint, make_tiny_llama, write_tiny_gguf
from fd_kernels.native import FusedDecoderLayer
from fd_plugins.models.llama import LlamaFamily
from fd_plugins.platforms.cpu import CpuPlatform

PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11], list(range(40, 140))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


def _needs_cpp_kernels() -> None:
    if select_kernels(CpuPlatform().capabilities).chosen["linear"].name == "portable":
        pytest.skip("kept blocks need the C++ linear kernel (no compiler here)")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model as a GGUF like the default model's: Q4_1 projections, Q8_0 embedding and head."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf"
    return str(write_tiny_gguf(path, tiny_model_dir, tensor_type="Q4_1",
                               tensor_types={"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}))


def _llm(source: str, quantized_weights: str, linear_weights: str = "float32", linear_inputs: str = "float32",
         attention_inputs: str = "float32", **cache: bool | str) -> LLM:
    return LLM(config=load_config(model={"source": source, "quantized_weights": quantized_weights,
                                         "linear_weights": linear_weights, "linear_inputs": linear_inputs,
                                         "attention_inputs": attention_inputs},
                                  cache={"num_blocks": 64, **cache}))


def _answers(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in outputs]


def _fuse_only(model: LlamaForCausalLM, fused_layers: tuple[int, ...]) -> None:
    """Drop every layer's fused binding but those of ``fused_layers``: the others run op by op."""
    model.layers = [layer if i in fused_layers else dataclasses.replace(layer, fused=None)
                    for i, layer in enumerate(model.layers)]
    model.runs = layer_runs(model.layers, model.kernels.decoder_layer)


def _all_blocks_free(llm: LLM) -> bool:
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks


def test_kept_blocks_answer_as_the_dequantized_weights_and_free_every_block(tiny_gguf) -> None:
    _needs_cpp_kernels()
    kept, dequantized = _llm(tiny_gguf, "keep"), _llm(tiny_gguf, "dequantize")
    layer = kept.engine.runner.model.layers[0]
    assert (layer.qkv.bits, layer.gate_up.bits, kept.engine.runner.model.lm_head.bits) == (4, 4, 8)
    got, want = _answers(kept), _answers(dequantized)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens   # the same weight values: only the matmul's order of sums differs
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-4, atol=1e-4)
    assert _all_blocks_free(kept) and _all_blocks_free(dequantized)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory) -> str:
    """A tiny Llama of 256-wide rows as a Q4_K_M-style GGUF: Q4_K matrices, a Q6_K head, v and down
    projection of layer 0 (a scale per 16: its q/k/v stack mixes them), a Q5_K gate of layer 1."""
    from tests.fd_core.model.gguf_encoders import write_gguf

    folder = tmp_path_factory.mktemp("wide") / "wide-llama"
    make_tiny_llama(folder, hidden=256, intermediate=256)
    path = folder.parent / "tiny-q4_k_m.gguf"
    return str(write_gguf(path, folder, tensor_type="Q4_K",
                          tensor_types={"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K",
                                        "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_gate.weight": "Q5_K"}))


def test_kept_k_quant_blocks_answer_as_the_dequantized_weights(k_quant_gguf) -> None:
    """Q4_K / Q5_K / Q6_K stay in blocks (no float32 copy) and decode what their float32 values
    do, fused and op by op alike."""
    _needs_cpp_kernels()
    kept, dequantized = _llm(k_quant_gguf, "keep", enable_prefix_caching=False), _llm(k_quant_gguf, "dequantize")
    model = kept.engine.runner.model
    layouts = [(linear.bits, linear.mins.shape[1] * 32 // linear.scales.shape[1])
               for linear in (model.layers[0].qkv, model.layers[0].down, model.layers[1].gate_up, model.lm_head)]
    assert layouts == [(8, 16), (8, 16), (8, 32), (8, 16)]   # bits, values per scale
    assert (model.layers[1].qkv.bits, model.layers[1].down.bits) == (4, 4)
    assert all(layer.fused is not None for layer in model.layers)
    got, want = _answers(kept), _answers(dequantized)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-4, atol=1e-4)
    _fuse_only(model, ())
    assert _answers(kept) == got
    assert _all_blocks_free(kept) and _all_blocks_free(dequantized)


# 93 prompt tokens: the prefill step runs fused too (steps of 128 tokens or more run op by op,
# where the quantized linear hands its matmuls to MKL); no prefix caching, so reruns take the same steps
@pytest.mark.parametrize("prompts", [PROMPTS[:2] + [list(range(40, 90))], PROMPTS],
                         ids=["fused-prefill", "big-prefill"])
def test_the_fused_layer_equals_the_op_by_op_layer_exactly(tiny_gguf, prompts: list[list[int]]) -> None:
    _needs_cpp_kernels()
    llm = _llm(tiny_gguf, "keep", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert llm.engine.runner.kernels.chosen["decoder_layer"].name == "cpp"
    assert all(layer.fused is not None for layer in model.layers)
    fused = _answers(llm, prompts)
    assert _answers(llm, prompts) == fused   # reproducible
    _fuse_only(model, ())
    assert _answers(llm, prompts) == fused   # the same kernels in the same order: bit-identical log-probabilities
    assert _all_blocks_free(llm)


# a run of fused layers after an op-by-op one starts from a residual stream; one before hands it on
@pytest.mark.parametrize("fused_layers", [(0,), (1,)], ids=["first-fused", "second-fused"])
def test_runs_of_fused_and_op_by_op_layers_equal_the_op_by_op_model_exactly(tiny_gguf, fused_layers) -> None:
    _needs_cpp_kernels()
    llm = _llm(tiny_gguf, "keep", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert [(run.start, run.stop, run.fused is not None) for run in model.runs] == [(0, 2, True)]
    bound = model.layers
    _fuse_only(model, ())
    op_by_op = _answers(llm)
    model.layers = bound
    _fuse_only(model, fused_layers)
    assert [(run.start, run.stop, run.fused is not None) for run in model.runs] == [(0, 1, 0 in fused_layers),
                                                                                   (1, 2, 1 in fused_layers)]
    assert _answers(llm) == op_by_op
    assert _all_blocks_free(llm)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe_renormalized"])
def tiny_qwen3(request, tmp_path_factory) -> tuple[str, str, str]:
    """The plugin's tiny Qwen3 (q/k norms) or Qwen3-MoE (q/k norms; layer 0 dense, layer 1 experts),
    a vocabulary of 512 for the shared tokenizer: (its name, its folder, a folder for its GGUF: for
    Qwen3-MoE experts in every layer, as llama.cpp's files hold them)."""
    config = {**LlamaFamily().tiny_hf_configs()[request.param], "vocab_size": 512}
    folder = str(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=3))
    if "decoder_sparse_step" not in config:
        return request.param, folder, folder
    every = {**config, "decoder_sparse_step": 1}
    return request.param, folder, str(make_tiny_checkpoint(tmp_path_factory.mktemp("every"), every, seed=3))


# Q8_0 blocks from a GGUF (int8 inputs too), or bfloat16 panels with rounded inputs (the experts'
# MLP as one fd_bf16_mlp pass); 93 prompt tokens: the prefill step runs fused too, 143 not
@pytest.mark.parametrize("weights", ["q8_0", "q8_0-int8-inputs", "bfloat16-inputs"])
@pytest.mark.parametrize("prompts", [PROMPTS[:2] + [list(range(40, 90))], PROMPTS],
                         ids=["fused-prefill", "big-prefill"])
def test_qk_norm_and_moe_layers_run_fused_and_equal_the_op_by_op_layer_exactly(tiny_qwen3, tmp_path, weights: str,
                                                                                prompts: list[list[int]]) -> None:
    _needs_cpp_kernels()
    name, folder, gguf_folder = tiny_qwen3
    gguf = weights.startswith("q8_0")
    if gguf:
        source = str(write_tiny_gguf(tmp_path / "model.gguf", gguf_folder, tensor_type="Q8_0"))
        inputs = "int8" if weights == "q8_0-int8-inputs" else "float32"
        llm = _llm(source, "keep", linear_inputs=inputs, enable_prefix_caching=False)
    else:
        llm = _llm(folder, "dequantize", "bfloat16", "bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert all(layer.qk_norms is not None for layer in model.layers)
    moe = [False, "moe" in name] if not gguf or folder == gguf_folder else [True, True]
    assert [layer.moe is not None for layer in model.layers] == moe
    assert [(run.start, run.stop, run.fused is not None) for run in model.runs] == [(0, 2, True)]
    assert model.runs[0].fused.qk_norms == [1, 1]
    assert model.runs[0].fused.top_k == [3 * m for m in moe]
    fused = _answers(llm, prompts)
    assert _answers(llm, prompts) == fused   # reproducible
    _fuse_only(model, ())
    assert _answers(llm, prompts) == fused   # the same kernels with the same arguments: bit-identical
    assert _all_blocks_free(llm)


def test_layers_with_shared_experts_run_op_by_op(tmp_path) -> None:
    """ERNIE's shared experts stay outside the fused op: its MoE layers (1 and 2) run op by op, layer 0 fused."""
    _needs_cpp_kernels()
    config = {**LlamaFamily().tiny_hf_configs()["ernie4_5_moe"], "vocab_size": 512}
    folder = make_tiny_checkpoint(tmp_path / "ernie", config, seed=3)
    llm = _llm(str(folder), "dequantize", "bfloat16", "bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert [(run.start, run.stop, run.fused is not None) for run in model.runs] == [(0, 1, True), (1, 3, False)]
    fused = _answers(llm)
    _fuse_only(model, ())
    assert _answers(llm) == fused
    assert _all_blocks_free(llm)


# bfloat16 inputs: AMX tiles where the CPU has them; bfloat16 queries too, on heads of 32 dims (whole tiles)
@pytest.mark.parametrize(("linear_inputs", "attention_inputs"), [("float32", "float32"), ("bfloat16", "float32"),
                                                                 ("bfloat16", "bfloat16")])
def test_bfloat16_layers_run_fused_and_equal_the_op_by_op_layer_exactly(tiny_model_dir, tmp_path, linear_inputs: str,
                                                                        attention_inputs: str) -> None:
    _needs_cpp_kernels()
    if attention_inputs == "float32":
        llm = _llm(tiny_model_dir, "dequantize", "bfloat16", linear_inputs, enable_prefix_caching=False)
    else:
        source = str(make_tiny_llama(tmp_path / "model", heads=2, kv_heads=1, vocab=512, max_position_embeddings=512))
        llm = _llm(source, "dequantize", "bfloat16", linear_inputs, attention_inputs, enable_prefix_caching=False,
                   dtype="bfloat16")
    model = llm.engine.runner.model
    assert all(layer.fused is not None and layer.qkv.bits == 16 for layer in model.layers)
    assert all(layer.fused.round_inputs == [int(linear_inputs == "bfloat16")] * 4 for layer in model.layers)
    # layers rounded for AMX or vdpbf16ps never reach MKL: their 143-token prefill step runs fused as well
    capabilities = CpuPlatform().capabilities
    bf16_products = "amx_bf16" in capabilities or "bf16_dot_products" in capabilities
    limit = (FusedDecoderLayer.bf16_products_max_tokens if linear_inputs == "bfloat16" and bf16_products
             else FusedDecoderLayer.max_tokens)
    assert all(layer.fused.max_tokens == limit for layer in model.layers)
    fused = _answers(llm)
    _fuse_only(model, ())
    assert _answers(llm) == fused
    assert _all_blocks_free(llm)


# 93 prompt tokens: fused prefill; 100: op by op, the int8 values through MKL's sgemm
@pytest.mark.parametrize("prompts", [PROMPTS[:2] + [list(range(40, 90))], PROMPTS],
                         ids=["fused-prefill", "big-prefill"])
def test_int8_inputs_run_fused_equal_the_op_by_op_layer_and_free_every_block(tiny_gguf, prompts) -> None:
    _needs_cpp_kernels()
    llm = _llm(tiny_gguf, "keep", linear_inputs="int8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert all(layer.fused.round_inputs == [1, 1, 1, 1] for layer in model.layers) and model.lm_head.round_inputs
    int8 = _answers(llm, prompts)
    _fuse_only(model, ())
    assert _answers(llm, prompts) == int8   # the same kernels in the same order: bit-identical
    float_inputs = _answers(_llm(tiny_gguf, "keep", enable_prefix_caching=False), prompts)
    assert [logprobs for _, logprobs in int8] != [logprobs for _, logprobs in float_inputs]
    assert _all_blocks_free(llm)


def test_int8_linears_run_op_by_op_answer_alike_and_free_every_block(tiny_model_dir) -> None:
    _needs_cpp_kernels()
    llm = _llm(tiny_model_dir, "dequantize", linear_weights="int8", linear_inputs="int8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert all(layer.fused is None for layer in model.layers)   # the fused layer binds no int8 linears
    assert {type(w).__name__ for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} \
        == {type(model.lm_head).__name__} == {"_Int8"}
    int8 = _answers(llm)
    assert _answers(llm) == int8   # the same integer sums every time
    float32 = _answers(_llm(tiny_model_dir, "dequantize", enable_prefix_caching=False))
    assert [logprobs for _, logprobs in int8] != [logprobs for _, logprobs in float32]
    assert _all_blocks_free(llm)


def test_float32_layers_run_op_by_op(tiny_gguf) -> None:
    _needs_cpp_kernels()
    assert all(layer.fused is None for layer in _llm(tiny_gguf, "dequantize").engine.runner.model.layers)


def test_the_portable_kernels_run_block_quantized_weights_as_float32(tiny_gguf) -> None:
    """A model built directly (``import fd_core``) with kept blocks and no C++ kernels still runs."""
    from fd_core.model.gguf_loader import load_gguf

    arch, weights, _ = load_gguf(Path(tiny_gguf), keep_quantized=True)
    model = LlamaForCausalLM(arch, weights)
    assert model.layers[0].fused is None
    qkv_weight, transposed, _ = model.layers[0].qkv
    assert transposed and qkv_weight.shape == [arch.num_attention_heads * arch.head_dim * 2, arch.hidden_size]


def test_a_step_s_mlp_in_row_chunks_equals_the_whole_step(tiny_model_dir, monkeypatch) -> None:
    """The prefill step here (143 rows) runs op by op: its MLP cut into chunks of 7 rows gives the
    same tokens, and log-probabilities equal up to the order of sums: from 128 rows on the bfloat16
    linear multiplies by MKL's GEMM, whose sums on an AMD EPYC (its AVX2 path) change in the last
    bits with the row count (on the AMX Xeon they matched to the bit)."""
    from fd_core.model import llama

    _needs_cpp_kernels()
    llm = _llm(tiny_model_dir, "dequantize", "bfloat16", enable_prefix_caching=False)
    whole = _answers(llm)
    monkeypatch.setattr(llama, "MLP_ROWS", 7)
    calls = []
    real_mlp = llama.LlamaForCausalLM._mlp
    monkeypatch.setattr(llama.LlamaForCausalLM, "_mlp", lambda self, h, layer: calls.append(h.shape[0])
                        or real_mlp(self, h, layer))
    chunked = _answers(llm)
    assert [tokens for tokens, _ in chunked] == [tokens for tokens, _ in whole]
    for (_, logprobs), (_, expected) in zip(chunked, whole, strict=True):
        np.testing.assert_allclose(logprobs, expected, rtol=0, atol=1e-4)
    assert max(calls) > 7   # the long step went through the chunked MLP
    assert _all_blocks_free(llm)
