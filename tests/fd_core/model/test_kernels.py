"""Kernel selection from capabilities, and the RMSNorm kernels against a numpy reference."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.contracts.platform import FUSED_RMS_NORM, PAGED_ATTENTION
from fd_core.model.kernels import KERNEL_VARIANTS, PORTABLE_KERNELS, select_kernels
from fd_kernels.rms_norm import rms_norm_fused, rms_norm_portable
from fd_plugins.platforms.cpu import CpuPlatform

HOST_HAS_FUSED = FUSED_RMS_NORM in CpuPlatform().capabilities
needs_fused = pytest.mark.skipif(not HOST_HAS_FUSED, reason="this CPU lacks avx512f: Paddle's fused_rms_norm "
                                                            "would die with SIGILL here")


def test_fused_rms_norm_is_chosen_only_when_declared() -> None:
    assert select_kernels({PAGED_ATTENTION, FUSED_RMS_NORM}).chosen["rms_norm"].name == "fused"
    assert select_kernels({PAGED_ATTENTION, "avx2", "avx512f"}).chosen["rms_norm"].name == "portable"
    assert select_kernels(()).rms_norm is rms_norm_portable
    assert select_kernels({FUSED_RMS_NORM}).rms_norm is rms_norm_fused


def test_every_op_ends_with_a_variant_that_needs_nothing() -> None:
    for op, variants in KERNEL_VARIANTS.items():
        assert variants[-1].requires == frozenset(), op
    assert all(v.requires == frozenset() for v in PORTABLE_KERNELS.chosen.values())


def test_describe_says_what_a_better_kernel_would_need() -> None:
    assert PORTABLE_KERNELS.describe() == ("rms_norm=portable (cpp needs cpp_kernels, fused needs fused_rms_norm); "
                                           "rope_write_kv=reference (cpp needs cpp_kernels); "
                                           "linear=portable (mkl_packed needs cpp_kernels); "
                                           "swiglu=portable (cpp needs cpp_kernels); "
                                           "geglu=portable; "
                                           "attention=reference (cpp needs cpp_kernels); "
                                           "decoder_layer=composed (cpp needs cpp_kernels); "
                                           "moe_experts=grouped (cpp needs cpp_kernels)")
    assert select_kernels({FUSED_RMS_NORM}).describe().startswith("rms_norm=fused (cpp needs cpp_kernels); ")


def _reference(x: np.ndarray, weight: np.ndarray, eps: float, residual: np.ndarray | None) -> tuple:
    s = x if residual is None else x + residual
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * weight, s


def _inputs(rows: int, hidden: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, hidden)).astype(np.float32),
            (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
            rng.standard_normal((rows, hidden)).astype(np.float32))


@pytest.mark.parametrize("kernel", [rms_norm_portable, pytest.param(rms_norm_fused, marks=needs_fused)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_matches_numpy(kernel, with_residual: bool, rows: int) -> None:
    x, weight, residual = _inputs(rows)
    residual = residual if with_residual else None
    out, stream = kernel(paddle.to_tensor(x), paddle.to_tensor(weight), 1e-6,
                         None if residual is None else paddle.to_tensor(residual))
    expected_out, expected_stream = _reference(x, weight, 1e-6, residual)
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stream.numpy(), expected_stream, rtol=1e-6, atol=1e-6)
