"""``linear_weights = "int8"``: float32 weights as int8 codes per output channel, inputs as uint8
codes per row. The C++ kernel (MKL's integer GEMM) must give exactly the result that
``fd_kernels.quantized.int8_linear_exact`` defines (exact integer sums, one float32 scaling), on
whichever CPU runs the tests (vpdpbusd or vpmaddubsw inside MKL: the codes' range keeps the latter
exact); the portable kernel multiplies the same quantized values in float32."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.quantized import INT8_WEIGHT_LEVELS, int8_linear_exact, quantize_int8_channels, quantize_uint8_rows


def test_codes_stay_within_the_levels_and_rows_round_trip() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((40, 96)).astype(np.float32)
    weight[3] = 0.0   # an all-zero channel: scale 0, codes 0
    codes, scales = quantize_int8_channels(weight)
    assert codes.dtype == np.int8 and np.abs(codes).max() == INT8_WEIGHT_LEVELS and scales[3] == 0
    assert np.all(np.abs(codes[3]) == 0)
    np.testing.assert_allclose(codes * scales[:, None], weight, atol=float(scales.max()) / 2 + 1e-7)

    x = (rng.standard_normal((5, 96)) * 3 + 1).astype(np.float32)
    x[2] = 0.0
    x[4] = np.abs(x[4])   # all positive: the zero point is 0
    q, s, z = quantize_uint8_rows(x)
    assert q.dtype == np.uint8 and q.max() == 255 and s[2] == 0 and z[4] == 0 and np.all(q[2] == 0)
    np.testing.assert_allclose(s[:, None] * (q.astype(np.float32) - z[:, None]), x, atol=float(s.max()) / 2 + 1e-6)


@pytest.mark.parametrize(("rows", "k", "n", "transposed"), [
    (1, 64, 24, False), (7, 96, 70, True), (130, 576, 96, False), (600, 200, 40, True)])   # 600: two chunks
def test_cpp_equals_the_exact_integer_definition_bit_for_bit(linear, rows: int, k: int, n: int,
                                                             transposed: bool) -> None:
    rng = np.random.default_rng(rows + k)
    dense = (rng.standard_normal((k, n)) * rng.uniform(0.01, 3.0, size=(1, n))).astype(np.float32)   # [in, out]
    dense[:, 5] = 0.0
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10.0, size=(rows, 1)) + 0.5).astype(np.float32)
    x[0, :] = 0.0
    prepared = linear.prepare(paddle.to_tensor(np.ascontiguousarray(dense.T) if transposed else dense),
                              transposed=transposed, int8=True)
    got = linear(paddle.to_tensor(x), prepared).numpy()
    codes, scales = quantize_int8_channels(dense.T)
    want = int8_linear_exact(x, codes, scales)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[0] == 0) and np.all(got[:, 5] == 0)
    # close to float32 (a quantized product, not a wrong one) and to the portable kernel's float32 product
    reference = x @ dense
    assert np.abs(got - reference).max() <= 0.05 * np.abs(reference).max()
    portable = PORTABLE_LINEAR(paddle.to_tensor(x), PORTABLE_LINEAR.prepare(
        paddle.to_tensor(np.ascontiguousarray(dense.T) if transposed else dense), transposed=transposed, int8=True))
    np.testing.assert_allclose(portable.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_batched_inputs_keep_their_leading_shape_and_bias_adds(linear) -> None:
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((32, 16)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    got = linear(paddle.to_tensor(x), linear.prepare(paddle.to_tensor(dense), int8=True), paddle.to_tensor(bias))
    codes, scales = quantize_int8_channels(dense.T)
    assert got.shape == [2, 3, 16]
    np.testing.assert_array_equal(got.numpy(), int8_linear_exact(x, codes, scales) + bias)
