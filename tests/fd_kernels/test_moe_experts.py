"""The C++ mixture-of-experts op (``csrc/moe_experts.cc``) in every precision mode of the linear
kernels: given the same routing it equals the portable grouped experts (``fd_kernels.moe``) bit
for bit, at steps where an expert's products go to MKL too; its routing is the portable one's
definition (the same experts, weights within float32 rounding); a token's output has the same
bits alone as among 256 tokens wherever the linear kernel's own results do not depend on the row
count; a layer whose linears the C++ kernel did not prepare runs the portable path."""

from __future__ import annotations

import gguf
import numpy as np
import paddle
import pytest

from fd_core.model.arch import MoeShape
from fd_core.model.kernels import select_kernels
from fd_core.model.moe import MoeWeights, prepare_moe
from fd_kernels import native
from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.moe import GROUPED, BoundExperts, Router, grouped_experts, route
from fd_kernels.quantized import from_gguf_blocks, stack_rows
from fd_plugins.platforms.cpu import CpuPlatform

#: mode -> how the model's loader prepares a float32 expert weight (fd_core.model.llama's `linear`);
#: "blocks": GGUF blocks (gate/up Q4_1, down Q8_0), with int8 input blocks in gguf-blocks-int8.
MODES = {"float32": {}, "bf16-weights": {"bfloat16": True}, "bf16": {"bfloat16": True, "bfloat16_inputs": True},
         "int8": {"int8": True}, "gguf-blocks": "blocks", "gguf-blocks-int8": "blocks"}
#: Modes whose linear kernel's results depend on the step's row count, so a token's do:
#: MKL's float32 sgemm (packed B) sums in another order for one row than for 40 (seen at k = 1024 on
#: the AMD EPYC), and quant_linear.cc's float32-input tiles keep 4, 2 or 1 sums a row by tile height.
ROW_COUNT_DEPENDENT = {"float32", "gguf-blocks"}
GEMM_ROWS = 128   # kGemmRows of bf16_linear.cc and quant_linear.cc: from here an expert's products go to MKL
QWEN = MoeShape(16, 2, 96, renormalize=True)
ERNIE = MoeShape(8, 2, 64, renormalize=True, norm_min=1e-12, score_correction=True)


@pytest.fixture(scope="module")
def kernels():
    kernels = select_kernels(CpuPlatform().capabilities)
    if kernels.chosen["moe_experts"].name != "cpp":
        pytest.skip(f"no C++ kernels here: {kernels.describe()}")
    return kernels


def _layer(kernels, mode: str, shape: MoeShape, hidden: int, seed: int = 0) -> MoeWeights:
    rng = np.random.default_rng(seed)
    weights = {name: (rng.standard_normal(size) * 0.2).astype(np.float32)
               for name, size in shape.weight_shapes("mlp.", hidden).items()}
    options = MODES[mode]

    def tensor(array):
        return paddle.to_tensor(np.ascontiguousarray(array, np.float32))

    def blocks(matrix):
        kind = "Q8_0" if matrix.shape[0] == hidden else "Q4_1"   # down in 8 bits, gate and up in 4
        return from_gguf_blocks(kind, gguf.quants.quantize(matrix, gguf.GGMLQuantizationType[kind]), matrix.shape)

    def linear(*parts):   # Hugging Face [out, in] blocks, as fd_core.model.llama prepares them
        if options == "blocks":
            return kernels.linear.prepare(stack_rows([blocks(p) for p in parts]), int8_inputs=mode.endswith("int8"))
        return kernels.linear.prepare(tensor(np.concatenate(parts, axis=0).T), **options)

    return prepare_moe(shape, "mlp.", weights, tensor, linear, kernels.moe_experts.bind)


def _run(kernels, h, moe: MoeWeights) -> np.ndarray:
    return kernels.moe_experts(h, moe.bound, kernels.linear, kernels.swiglu).numpy()


def _route_cpp(h, bound) -> tuple[np.ndarray, np.ndarray]:
    ops = native.load_native(CpuPlatform().capabilities)
    chosen, weights = ops.fd_moe_route(h, bound.router, bound.correction, bound.top_k, bound.renormalize,
                                       bound.norm_min, 2)
    return chosen.numpy(), weights.numpy()


@pytest.mark.parametrize("shape", [QWEN, ERNIE], ids=["qwen3", "ernie"])
@pytest.mark.parametrize("mode", MODES)
def test_the_op_equals_the_grouped_experts_given_its_routing(kernels, mode: str, shape: MoeShape) -> None:
    moe = _layer(kernels, mode, shape, hidden=64)
    assert isinstance(moe.bound, native.ExpertOperands)
    rng = np.random.default_rng(1)
    for tokens in (1, 37, 1200):
        h = paddle.to_tensor(rng.standard_normal((tokens, 64)).astype(np.float32))
        chosen, weights = _route_cpp(h, moe.bound)
        got = _run(kernels, h, moe)
        want = grouped_experts(h, chosen, weights, moe.experts, kernels.linear, kernels.swiglu).numpy()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(_run(kernels, h, moe), got)   # and run to run
    assert np.bincount(chosen.ravel()).max() >= GEMM_ROWS   # the 1200-token step took the MKL paths too


@pytest.mark.parametrize("shape", [QWEN, ERNIE], ids=["qwen3", "ernie"])
def test_the_ops_routing_is_the_portable_definition(kernels, shape: MoeShape) -> None:
    moe = _layer(kernels, "float32", shape, hidden=64)
    h = paddle.to_tensor(np.random.default_rng(2).standard_normal((300, 64)).astype(np.float32))
    chosen, weights = _route_cpp(h, moe.bound)
    bound = moe.bound   # its router rows transposed back, its correction (zeros for Qwen: adds nothing)
    want_chosen, want_weights = route(h, Router(paddle.to_tensor(bound.router.numpy().T.copy()), bound.correction,
                                                bound.top_k, bound.renormalize, bound.norm_min))
    np.testing.assert_array_equal(chosen, want_chosen)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
    assert np.allclose(weights.sum(axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_tokens_output_is_the_same_alone_and_among_256(kernels, mode: str) -> None:
    moe = _layer(kernels, mode, MoeShape(16, 2, 128, renormalize=True), hidden=256)
    h = paddle.to_tensor(np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32))
    among = _run(kernels, h, moe)
    chosen, _ = _route_cpp(h, moe.bound)
    assert np.bincount(chosen.ravel()).max() < GEMM_ROWS   # every expert on the same kernel path alone or not
    alone = np.concatenate([_run(kernels, h[row:row + 1], moe) for row in range(256)])
    if mode in ROW_COUNT_DEPENDENT:
        np.testing.assert_allclose(alone, among, rtol=0, atol=1e-5 * np.abs(among).max())   # the sums' rounding
    else:
        np.testing.assert_array_equal(alone, among)


def test_a_layer_with_portable_linears_runs_the_grouped_path(kernels) -> None:
    rng = np.random.default_rng(4)
    weights = {name: (rng.standard_normal(size) * 0.2).astype(np.float32)
               for name, size in QWEN.weight_shapes("mlp.", 64).items()}

    def tensor(array):
        return paddle.to_tensor(np.ascontiguousarray(array, np.float32))

    moe = prepare_moe(QWEN, "mlp.", weights, tensor,
                      lambda *parts: PORTABLE_LINEAR.prepare(tensor(np.concatenate(parts, axis=0).T)),
                      kernels.moe_experts.bind)
    assert isinstance(moe.bound, BoundExperts)
    h = paddle.to_tensor(rng.standard_normal((20, 64)).astype(np.float32))
    np.testing.assert_array_equal(_run(kernels, h, moe), GROUPED(h, moe.bound, PORTABLE_LINEAR, kernels.swiglu).numpy())
