"""Block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K kept in
their blocks): the container equals gguf's own dequantization bit for bit, and the C++ matmul
that widens the blocks in registers equals a float32 matmul of the dequantized weight (up to the
order of the sums); with int8 inputs, the same matmul of the inputs' int8 block values (integer
dot products in C++)."""

from __future__ import annotations

import gguf
import numpy as np
import paddle
import pytest

from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.quantized import (
    GGUF_BLOCK_TYPES,
    BlockQuantized,
    from_gguf_blocks,
    int8_block_values,
    quantize_int8_blocks,
    stack_rows,
)
from tests.fd_core.model.gguf_encoders import quantize

KINDS = tuple(GGUF_BLOCK_TYPES)
#: (code bits, values per scale) each kind is kept as
LAYOUTS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}


def _gguf_tensor(rng: np.random.Generator, kind: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes, gguf's float32 dequantization) of a random [rows, cols] matrix."""
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, size=(rows, 1))).astype(np.float32)
    values[0, :256] = 0.0   # an all-zero block (super-block for K-quants): scale 0
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quantize(values, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_as_gguf_does_bit_for_bit(kind: str) -> None:
    raw, want = _gguf_tensor(np.random.default_rng(1), kind, 24, 512)
    weight = from_gguf_blocks(kind, raw, (24, 512))
    assert weight.shape == (24, 512) and (weight.bits, weight.group) == LAYOUTS[kind]
    assert weight.nbytes < want.nbytes / 2.9
    np.testing.assert_array_equal(weight.dequantize(), want)
    np.testing.assert_array_equal(weight.widened().dequantize(), want)
    np.testing.assert_array_equal(weight.halved().dequantize(), want)


def test_rows_stack_reorder_and_scale_like_the_float32_matrix() -> None:
    rng = np.random.default_rng(2)
    (raw4, dense4), (raw8, dense8) = _gguf_tensor(rng, "Q4_1", 8, 64), _gguf_tensor(rng, "Q8_0", 4, 64)
    q4, q8 = from_gguf_blocks("Q4_1", raw4, (8, 64)), from_gguf_blocks("Q8_0", raw8, (4, 64))
    mixed = stack_rows([q4, q8])   # mixed widths: widened to 8 bits
    assert mixed.bits == 8
    np.testing.assert_array_equal(mixed.dequantize(), np.concatenate([dense4, dense8]))
    assert stack_rows([q4, q4]).bits == 4
    order = rng.permutation(8)
    np.testing.assert_array_equal(q4.take_rows(order).dequantize(), dense4[order])
    np.testing.assert_array_equal(q4.scaled(0.125).dequantize(), dense4 * np.float32(0.125))
    # a Q4_K_M q/k/v: Q4_K q and k, a Q6_K v (a scale per 16): widened and halved
    (raw_k, dense_k), (raw_6, dense_6) = _gguf_tensor(rng, "Q4_K", 8, 256), _gguf_tensor(rng, "Q6_K", 4, 256)
    qkv = stack_rows([from_gguf_blocks("Q4_K", raw_k, (8, 256)), from_gguf_blocks("Q6_K", raw_6, (4, 256))])
    assert (qkv.bits, qkv.group) == (8, 16)
    np.testing.assert_array_equal(qkv.dequantize(), np.concatenate([dense_k, dense_6]))
    np.testing.assert_array_equal(qkv.scaled(0.5).dequantize(), np.concatenate([dense_k, dense_6]) * np.float32(0.5))


def test_a_malformed_tensor_is_refused_with_its_shape() -> None:
    with pytest.raises(ValueError, match="shape \\[4, 40\\]"):
        from_gguf_blocks("Q4_1", np.zeros(4 * 40, np.uint8), (4, 40))
    with pytest.raises(ValueError, match="shape \\[4, 128\\]"):   # K-quants come in super-blocks of 256
        from_gguf_blocks("Q4_K", np.zeros(4 * 72, np.uint8), (4, 128))
    with pytest.raises(ValueError, match="do not hold 2 rows"):
        BlockQuantized(4, np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="not one or two per block"):
        BlockQuantized(8, np.zeros((2, 32), np.uint8), np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32))


# 1: a decode row; 3 and 13: partial tiles of 8; 64: one row task; 100: two, the last partial;
# 150: past kGemmRows, the widened weight through MKL's sgemm
@pytest.mark.parametrize("rows", [1, 3, 13, 64, 100, 150])
@pytest.mark.parametrize("kind", KINDS)
def test_cpp_quantized_matmul_equals_float32_matmul_of_the_dequantized_weight(linear, kind: str, rows: int) -> None:
    rng = np.random.default_rng(rows)
    cols = _cols(kind)
    raw, dense = _gguf_tensor(rng, kind, 37, cols)      # 37 features: tasks of 16 plus a remainder
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    bias = rng.standard_normal(37).astype(np.float32)
    prepared = linear.prepare(from_gguf_blocks(kind, raw, (37, cols)))
    got = linear(paddle.to_tensor(x), prepared, paddle.to_tensor(bias)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ dense.T.astype(np.float64) + bias, rtol=2e-5, atol=2e-5)
    assert linear(paddle.to_tensor(x[:0]), prepared).shape == [0, 37]


def _cols(kind: str) -> int:
    """Input width of a test matrix: 5 blocks of 32 (one left over by the two chains of blocks), or
    two super-blocks of 256 for the K-quants."""
    return 160 if GGUF_BLOCK_TYPES[kind][0] == 32 else 512


def test_cpp_quantized_matmul_takes_leading_dimensions(linear) -> None:
    rng = np.random.default_rng(5)
    raw, dense = _gguf_tensor(rng, "Q4_1", 16, 64)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = linear(paddle.to_tensor(x), linear.prepare(from_gguf_blocks("Q4_1", raw, (16, 64)))).numpy()
    assert got.shape == (2, 3, 16)
    np.testing.assert_allclose(got, x @ dense.T, rtol=2e-5, atol=2e-5)


def test_portable_linear_dequantizes_a_quantized_weight() -> None:
    rng = np.random.default_rng(6)
    raw, dense = _gguf_tensor(rng, "Q8_0", 12, 64)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    got = PORTABLE_LINEAR(paddle.to_tensor(x), PORTABLE_LINEAR.prepare(from_gguf_blocks("Q8_0", raw, (12, 64))))
    np.testing.assert_allclose(got.numpy(), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_inputs_quantize_to_int8_blocks_of_32() -> None:
    x = np.random.default_rng(7).standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0                                        # an all-zero block: scale 0, codes 0
    x[2, :32] = np.float32(2.5) * np.sign(x[2, :32])         # max 2.5 -> scale 2.5/127: codes +-127
    codes, scales = quantize_int8_blocks(x)
    assert codes.dtype == np.int8 and codes.shape == (3, 96) and scales.shape == (3, 3)
    assert scales[1, 1] == 0 and not codes[1, 32:64].any()
    assert set(np.abs(codes[2, :32]).tolist()) == {127}
    np.testing.assert_array_equal(scales, np.abs(x.reshape(3, 3, 32)).max(-1) / np.float32(127))
    assert np.abs(codes.astype(np.int32)).max() <= 127
    values = int8_block_values(x)
    assert np.all(np.abs(values - x).reshape(3, 3, 32) <= scales[..., None] / 2 * (1 + 1e-6))
    # nearest even at an exact tie: x / d = 2.5 rounds to 2, -3.5 to -4
    tie = np.zeros(32, np.float32)
    tie[:3] = [127.0, 2.5, -3.5]
    np.testing.assert_array_equal(quantize_int8_blocks(tie)[0][:3], [127, 2, -4])


# 1 and 2: decode rows (two chains of blocks, 5 blocks a row: one left over); 3 and 13: partial
# tiles; 100: two row tasks; 150: past kGemmRows, the inputs' int8 values through MKL's sgemm
@pytest.mark.parametrize("rows", [1, 2, 3, 13, 100, 150])
@pytest.mark.parametrize("kind", KINDS)
def test_cpp_int8_input_matmul_equals_float_matmul_of_the_int8_values(linear, kind: str, rows: int) -> None:
    rng = np.random.default_rng(rows + 11)
    cols = _cols(kind)
    raw, dense = _gguf_tensor(rng, kind, 37, cols)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 10, size=(rows, 1))).astype(np.float32)
    x[0, 32:64] = 0.0   # an all-zero input block
    bias = rng.standard_normal(37).astype(np.float32)
    weight = from_gguf_blocks(kind, raw, (37, cols))
    got = linear(paddle.to_tensor(x), linear.prepare(weight, int8_inputs=True), paddle.to_tensor(bias)).numpy()
    want = int8_block_values(x).astype(np.float64) @ dense.T.astype(np.float64) + bias
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)
    float_inputs = linear(paddle.to_tensor(x), linear.prepare(weight), paddle.to_tensor(bias)).numpy()
    assert np.abs(float_inputs - got).max() > 1e-4 * scale   # the inputs were quantized
    portable = PORTABLE_LINEAR(paddle.to_tensor(x), PORTABLE_LINEAR.prepare(weight, int8_inputs=True),
                               paddle.to_tensor(bias)).numpy()
    np.testing.assert_allclose(portable, want, rtol=2e-5, atol=2e-5 * scale)
