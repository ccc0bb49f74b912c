"""bfloat16 linear weights (``linear_weights = "bfloat16"``): float32 weights rounded to nearest
even as Paddle's cast rounds them, stored in 16 bits by the C++ linear kernel and widened inside
its matmul, equal to a float64 matmul of the float32 input and the rounded weight (float32 sums:
only their order differs), on the tiled path and the MKL path; the portable linear rounds the same
values and keeps them in float32."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_kernels import native
from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.quantized import bfloat16_codes, round_to_bfloat16
from fd_plugins.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module")
def linear():
    try:
        return native.prepare_linear(CpuPlatform().capabilities)
    except native.NativeKernelsUnavailable as exc:
        pytest.skip(str(exc))


def _ties_and_specials() -> np.ndarray:
    one = int(np.float32(1.0).view(np.uint32))
    halfway = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001], np.uint32).view(np.float32)
    return np.concatenate([halfway, np.float32([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-40, -2.5])])


def test_rounding_is_paddles_cast_to_bfloat16() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([_ties_and_specials(), (rng.standard_normal(3989) * 10.0 ** rng.integers(-30, 30, 3989))
                             .astype(np.float32)])
    want = paddle.to_tensor(values).astype("bfloat16").astype("float32").numpy()
    np.testing.assert_array_equal(round_to_bfloat16(values), want)
    one = np.float32(1.0).view(np.uint32)
    assert list(round_to_bfloat16(_ties_and_specials()[:4]).view(np.uint32)) == [one, one + 0x20000, one, one + 0x10000]
    assert np.isnan(round_to_bfloat16(np.float32([np.nan]))).all()
    codes = bfloat16_codes(values.reshape(4, -1))
    assert codes.dtype == np.uint8 and codes.shape == (4, values.size // 2)
    widened = (codes.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(-1)
    np.testing.assert_array_equal(widened, want)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 100, 150])   # partial tiles, row tasks, 128+: MKL
@pytest.mark.parametrize(("k", "n"), [(64, 37), (576, 160)])
def test_the_matmul_equals_float64_over_the_rounded_weight(linear, rows: int, k: int, n: int) -> None:
    rng = np.random.default_rng(rows * k + n)
    dense = rng.standard_normal((k, n)).astype(np.float32)   # [in, out]
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    x[0, :4] = [1e-30, -1e30, 0.0, 65504.0]
    bias = rng.standard_normal(n).astype(np.float32)
    prepared = linear.prepare(paddle.to_tensor(dense), bfloat16=True)
    assert prepared.bits == 16 and prepared.codes.shape == [n, 2 * k]
    got = linear(paddle.to_tensor(x), prepared, paddle.to_tensor(bias)).numpy()
    rounded = round_to_bfloat16(dense).astype(np.float64)
    want = x.astype(np.float64) @ rounded + bias
    scale = np.abs(x).astype(np.float64) @ np.abs(rounded) + 1
    assert got.shape == (rows, n)
    assert np.all(np.abs(got - want) <= 2e-6 * scale)
    np.testing.assert_array_equal(linear(paddle.to_tensor(x), prepared, paddle.to_tensor(bias)).numpy(), got)
    portable = PORTABLE_LINEAR(paddle.to_tensor(x), PORTABLE_LINEAR.prepare(paddle.to_tensor(dense), bfloat16=True),
                               paddle.to_tensor(bias)).numpy()
    assert np.all(np.abs(portable - want) <= 2e-6 * scale)   # the same values, kept in float32
    assert linear(paddle.to_tensor(x[:0]), prepared).shape == [0, n]


def test_a_tied_head_is_stored_from_the_embedding_rows(linear) -> None:
    rng = np.random.default_rng(3)
    embedding = rng.standard_normal((50, 96)).astype(np.float32)   # [vocab, hidden]
    x = rng.standard_normal((5, 96)).astype(np.float32)
    prepared = linear.prepare(paddle.to_tensor(embedding), transposed=True, bfloat16=True)
    want = x.astype(np.float64) @ round_to_bfloat16(embedding).astype(np.float64).T
    np.testing.assert_allclose(linear(paddle.to_tensor(x), prepared).numpy(), want, rtol=1e-5, atol=1e-5)


def test_an_input_width_off_the_block_stays_float32(linear) -> None:
    dense = np.random.default_rng(4).standard_normal((40, 16)).astype(np.float32)   # 40 inputs: not 32k
    x = np.random.default_rng(5).standard_normal((3, 40)).astype(np.float32)
    prepared = linear.prepare(paddle.to_tensor(dense), bfloat16=True)
    assert not hasattr(prepared, "bits")
    np.testing.assert_allclose(linear(paddle.to_tensor(x), prepared).numpy(), x @ dense, rtol=1e-5, atol=1e-5)
