"""The C++ decode kernel (reading KV blocks in place) against the reference kernel, on random
shapes: block sizes 16 and 64, GQA groups 1-4, ragged contexts, shuffled block tables."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.model.kernels import select_kernels
from fd_kernels import native
from fd_kernels import paged_attention as pa
from fd_plugins.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module")
def cpp_decode():
    """The C++ variant built for this host's declared capabilities (skipped without a compiler)."""
    try:
        return native.prepare_decode_attention(CpuPlatform().capabilities)
    except native.NativeKernelsUnavailable as exc:
        if "no C++ compiler" in str(exc):
            pytest.skip(str(exc))
        raise


class _Step:
    """The decode-row metadata both kernels read."""

    def __init__(self, tables: np.ndarray, context: np.ndarray, block_size: int, num_heads: int,
                 num_kv_heads: int) -> None:
        width = tables.shape[1]
        self.decode_tables = paddle.to_tensor(tables)
        self.decode_lens = paddle.to_tensor(context)
        self.decode_index = paddle.to_tensor(pa.gather_index(tables, num_kv_heads))
        self.decode_mask = paddle.to_tensor(pa.decode_mask(context, width * block_size, num_heads))


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 2, 32)])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_cpp_decode_matches_the_reference(cpp_decode, block_size: int, heads: int, kv_heads: int,
                                          head_dim: int, rows: int) -> None:
    rng = np.random.default_rng(block_size * 1000 + heads * 10 + rows)
    num_blocks = 96
    k_cache = paddle.to_tensor(rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(np.float32))
    context = rng.integers(1, 4 * block_size, size=rows).astype(np.int64)
    width = int(-(-context.max() // block_size))
    tables = np.stack([rng.permutation(num_blocks)[:width] for _ in range(rows)]).astype(np.int64)
    q = paddle.to_tensor(rng.standard_normal((rows, heads, head_dim)).astype(np.float32))
    step = _Step(tables, context, block_size, heads, kv_heads)
    scale = 1 / np.sqrt(head_dim)
    want = pa.decode_attention_gathered(q, k_cache, v_cache, step, scale).numpy()
    got = cpp_decode(q, k_cache, v_cache, step, scale).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_a_strided_query_view_is_read_correctly(cpp_decode) -> None:
    rng = np.random.default_rng(7)
    k_cache = paddle.to_tensor(rng.standard_normal((8, 2, 16, 8)).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal((8, 2, 16, 8)).astype(np.float32))
    qkv = paddle.to_tensor(rng.standard_normal((3, 10, 8)).astype(np.float32))
    q = qkv[:, :4]                               # a view, as the model passes it
    step = _Step(np.array([[3, 1], [0, 7], [5, 2]]), np.array([20, 1, 32]), 16, 4, 2)
    want = pa.decode_attention_gathered(q.contiguous(), k_cache, v_cache, step, 0.5).numpy()
    np.testing.assert_allclose(cpp_decode(q, k_cache, v_cache, step, 0.5).numpy(), want, rtol=1e-5, atol=2e-6)


def test_the_start_up_line_names_the_cpp_kernel_or_why_not(cpp_decode) -> None:
    line = select_kernels(CpuPlatform().capabilities).describe()
    assert "decode_attention=cpp" in line
    assert "decode_attention=reference (cpp needs cpp_kernels)" in select_kernels({"paged_attention"}).describe()


def test_a_failed_build_falls_back_to_the_reference_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native, "_loaded", {})
    kernels = select_kernels({"paged_attention", "cpp_kernels"})
    assert kernels.decode_gathers
    assert "decode_attention=reference (cpp: no C++ compiler on PATH" in kernels.describe()


def test_isa_flags_follow_the_declared_features_only() -> None:
    assert native.isa_flags({"avx2", "fma"}) == ("-mavx2", "-mfma")
    assert "-mavx512f" in native.isa_flags({"avx2", "fma", "avx512f"})
    assert native.isa_flags({"avx512f"}) == ()     # never more than what is declared together
    assert native.cache_dir(("-mavx2", "-mfma")) != native.cache_dir(())
