"""bfloat16 linear weights (``linear_weights = "bfloat16"``): float32 weights rounded to nearest
even as Paddle's cast rounds them, stored in 16-bit panels by the C++ linear kernel
(``csrc/bf16_linear.cc``) and widened inside its matmul, equal to a float64 matmul of the float32
input and the rounded weight (float32 sums: only their order differs), on partial tiles and panels
and on the MKL path; the portable linear rounds the same values and keeps them in float32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from fd_kernels import native
from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.quantized import round_to_bfloat16
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


@pytest.mark.parametrize("transposed", [False, True])
def test_the_panels_hold_the_rounded_weight(linear, transposed: bool) -> None:
    k, n = 37, 40   # a partial last panel, padded with zeros
    dense = np.random.default_rng(7).standard_normal((k, n)).astype(np.float32)
    dense[0, :11] = _ties_and_specials()
    weight = paddle.to_tensor(dense.T.copy() if transposed else dense)
    packed = linear.prepare(weight, transposed=transposed, bfloat16=True).data.numpy()
    # the build's vector width, and k padded to pairs (to AMX tile rows of 32 where built in)
    lanes, kp = next((lanes, -(-k // step) * step) for lanes in (16, 8) for step in (32, 2)
                     if packed.size == -(-n // lanes) * lanes * -(-k // step) * step * 2)
    values = (packed.view("<u2").astype(np.uint32) << 16).view(np.float32)
    padded = np.zeros((kp, -(-n // lanes) * lanes), np.float32)
    padded[:k, :n] = round_to_bfloat16(dense)
    want = padded.reshape(kp // 2, 2, -1, lanes).transpose(2, 0, 3, 1).reshape(-1)   # [panel, k pair, lane, 2]
    np.testing.assert_array_equal(values, want)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 100, 150])   # partial tiles, row tasks, 128+: MKL
@pytest.mark.parametrize(("k", "n"), [(37, 40), (576, 160)])
def test_the_matmul_equals_float64_over_the_rounded_weight(linear, rows: int, k: int, n: int) -> None:
    rng = np.random.default_rng(rows * k + n)
    dense = rng.standard_normal((k, n)).astype(np.float32)   # [in, out]
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    x[0, :4] = [1e-30, -1e30, 0.0, 65504.0]
    bias = rng.standard_normal(n).astype(np.float32)
    prepared = linear.prepare(paddle.to_tensor(dense), bfloat16=True)
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



@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 150])   # one short tile, whole and partial tiles, 128+
@pytest.mark.parametrize(("k", "n"), [(37, 40), (576, 160)])
def test_rounded_inputs_equal_float64_over_both_rounded(linear, rows: int, k: int, n: int) -> None:
    """``bfloat16_inputs``: AMX tiles where the build has them, else the float32 path on rounded rows."""
    rng = np.random.default_rng(rows + k * n)
    dense = rng.standard_normal((k, n)).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    x[0, :3] = _ties_and_specials()[:3]
    prepared = linear.prepare(paddle.to_tensor(dense), bfloat16=True, bfloat16_inputs=True)
    got = linear(paddle.to_tensor(x), prepared).numpy()
    rounded_x, rounded_w = (round_to_bfloat16(a).astype(np.float64) for a in (x, dense))
    want = rounded_x @ rounded_w
    scale = np.abs(rounded_x) @ np.abs(rounded_w) + 1
    assert got.shape == (rows, n)
    assert np.all(np.abs(got - want) <= 2e-6 * scale)
    assert np.abs(x @ round_to_bfloat16(dense) - got).max() > 0   # the inputs were rounded
    np.testing.assert_array_equal(linear(paddle.to_tensor(x), prepared).numpy(), got)
    portable = PORTABLE_LINEAR(paddle.to_tensor(x), PORTABLE_LINEAR.prepare(
        paddle.to_tensor(dense), bfloat16=True, bfloat16_inputs=True)).numpy()
    assert np.all(np.abs(portable - want) <= 2e-6 * scale)


@pytest.mark.skipif("amx_bf16" not in CpuPlatform().capabilities, reason="the AMX tiles' blocking (no amx_bf16 here)")
@pytest.mark.parametrize(("k", "n"), [(600, 70), (1536, 96)])   # k in 3 and 6 passes over 32-row blocks
@pytest.mark.parametrize("rows", [100, 1000])   # the threads share the panels out; at 1000 rows, the rows
def test_amx_rows_get_the_same_bits_alone_or_in_a_prefill(linear, k: int, n: int, rows: int) -> None:
    """On AMX a task of many rows runs k in passes (its panels then stay in L1), keeping its blocks'
    sums in memory between them; a row alone runs k in one pass. The sums run over k in one order
    either way, so a row's result is the same bits in a batch of 1, of 100 and of 1000 (where the
    threads share out the rows instead of the panels)."""
    rng = np.random.default_rng(k + n)
    dense = rng.standard_normal((k, n)).astype(np.float32)
    prepared = linear.prepare(paddle.to_tensor(dense), bfloat16=True, bfloat16_inputs=True)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    batch = linear(paddle.to_tensor(x), prepared).numpy()
    for row in (0, 77, rows - 1):
        np.testing.assert_array_equal(linear(paddle.to_tensor(x[row:row + 1]), prepared).numpy()[0], batch[row])
    rounded_x, rounded_w = (round_to_bfloat16(a).astype(np.float64) for a in (x, dense))
    assert np.all(np.abs(batch - rounded_x @ rounded_w) <= 2e-6 * (np.abs(rounded_x) @ np.abs(rounded_w) + 1))


# m = 64: whole AMX tile columns (the fused pass where the CPU has AMX; with vdpbf16ps any multiple
# of 16 fuses, 160 too); 40: the three ops in a row.
# 700 rows: two chunks of the fused pass (512 rows, then 188), partial row tiles at the end of each
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 700])
@pytest.mark.parametrize(("hidden", "m"), [(48, 64), (37, 40), (96, 160)])
def test_the_mlp_equals_its_three_ops_to_the_bit(linear, rows: int, hidden: int, m: int) -> None:
    """``fd_bf16_mlp``: round(swiglu(round(h) @ gate_up)) @ down, as fd_bf16_linear, fd_swiglu and
    fd_bf16_linear (inputs rounded) give it, whichever way it runs here."""
    ops = native.load_native(CpuPlatform().capabilities)
    rng = np.random.default_rng(rows * hidden + m)
    gate_up = linear.prepare(paddle.to_tensor(rng.standard_normal((hidden, 2 * m)).astype(np.float32) * 0.3),
                             bfloat16=True, bfloat16_inputs=True)
    down = linear.prepare(paddle.to_tensor(rng.standard_normal((m, hidden)).astype(np.float32) * 0.3),
                          bfloat16=True, bfloat16_inputs=True)
    h = rng.standard_normal((rows, hidden)).astype(np.float32) * 2
    h[0, :3] = _ties_and_specials()[:3]
    h = paddle.to_tensor(h)
    got = ops.fd_bf16_mlp(h, gate_up.data, down.data, m, hidden, 2, "").numpy()
    gated = ops.fd_swiglu(ops.fd_bf16_linear(h, gate_up.data, 2 * m, 2, "", True), 2)
    want = ops.fd_bf16_linear(gated, down.data, hidden, 2, "", True).numpy()
    assert got.shape == (rows, hidden) and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ops.fd_bf16_mlp(h, gate_up.data, down.data, m, hidden, 1, "").numpy(), got)


def check_rounded_products(capabilities: list[str]) -> int:
    """The rounded-inputs linear and the MLP of the library built for ``capabilities``, against
    float64 and against its three ops (run in a subprocess: one build per process); the shapes checked."""
    ops = native.load_native(capabilities)
    checked = 0
    for rows, k, n in [(1, 37, 40), (13, 576, 160), (150, 96, 50), (300, 64, 48)]:
        rng = np.random.default_rng(rows * k)
        dense = rng.standard_normal((k, n)).astype(np.float32)
        x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
        packed = ops.fd_pack_bf16(paddle.to_tensor(dense), False)
        got = ops.fd_bf16_linear(paddle.to_tensor(x), packed, n, 2, "", True).numpy()
        rounded_x, rounded_w = (round_to_bfloat16(a).astype(np.float64) for a in (x, dense))
        scale = np.abs(rounded_x) @ np.abs(rounded_w) + 1
        assert np.all(np.abs(got - rounded_x @ rounded_w) <= 2e-6 * scale), (rows, k, n)
        checked += 1
    for rows, hidden, m in [(33, 37, 40), (33, 37, 64), (150, 96, 160)]:   # m = 40: the three ops; else fused
        gate_up = ops.fd_pack_bf16(paddle.to_tensor(rng.standard_normal((hidden, 2 * m)).astype(np.float32)), False)
        down = ops.fd_pack_bf16(paddle.to_tensor(rng.standard_normal((m, hidden)).astype(np.float32)), False)
        h = paddle.to_tensor(rng.standard_normal((rows, hidden)).astype(np.float32))
        gated = ops.fd_swiglu(ops.fd_bf16_linear(h, gate_up, 2 * m, 2, "", True), 2)
        np.testing.assert_array_equal(ops.fd_bf16_mlp(h, gate_up, down, m, hidden, 2, "").numpy(),
                                      ops.fd_bf16_linear(gated, down, hidden, 2, "", True).numpy())
        checked += 1
    return checked


def test_vdpbf16ps_tiles_where_the_hosts_build_does_not_use_them() -> None:
    """A CPU with avx512_bf16 whose platform multiplies bfloat16 otherwise (AMX) or widens it (Intel
    without AMX) still builds and checks the vdpbf16ps tiles that AMD's Zen 4 runs by default."""
    capabilities = CpuPlatform().capabilities
    if "avx512_bf16" not in capabilities or "cpp_kernels" not in capabilities:
        pytest.skip("this CPU has no avx512_bf16")
    if "-mavx512bf16" in native.isa_flags(capabilities):
        pytest.skip("the host's own build multiplies with vdpbf16ps: the tests above check it")
    forced = sorted((capabilities - {"amx_bf16", "amx_int8"}) | {"bf16_dot_products"})
    assert "-mavx512bf16" in native.isa_flags(forced)
    code = (f"from tests.kernels.test_bf16_linear import check_rounded_products; "
            f"print(check_rounded_products({json.dumps(forced)}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "7"
