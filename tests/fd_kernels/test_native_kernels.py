"""fd-engine's C++ kernels against the Paddle reference kernels, on random shapes: block sizes 16
and 64, GQA groups 1-4, ragged batches of decode rows and prefill chunks (rows that start past 0),
shuffled block tables; the metadata comes from the real builder, as the model gets it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fd_core.model.kernels import select_kernels
from fd_core.outputs import ScheduledRequest
from fd_core.request import Request
from fd_core.runner.attention_metadata import build_attention_metadata, order_rows
from fd_kernels import int8_cache, native, rms_norm
from fd_kernels import paged_attention as pa
from fd_plugins.platforms.cpu import CpuPlatform

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def cpp(prepared):
    """The C++ variants built for this host's declared capabilities (skipped without a compiler)."""
    return {"attention": prepared(native.prepare_attention), "rms_norm": prepared(native.prepare_rms_norm),
            "rope_write_kv": prepared(native.prepare_rope_write_kv), "swiglu": prepared(native.prepare_swiglu),
            "linear": prepared(native.prepare_linear)}


def _step(rng: np.random.Generator, rows: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int):
    """Metadata of a step whose rows are ``(start, num_new_tokens)``, over shuffled blocks."""
    scheduled = []
    for i, (start, new) in enumerate(rows):
        blocks = -(-(start + new) // block_size)
        table = rng.permutation(NUM_BLOCKS)[:blocks].tolist()
        scheduled.append(ScheduledRequest(Request(f"r{i}", list(range(start + new))), start, new, table, True))
    return build_attention_metadata(order_rows(scheduled), block_size=block_size, num_blocks=NUM_BLOCKS,
                                    num_heads=heads, num_kv_heads=kv_heads)


def _random(rng: np.random.Generator, *shape: int) -> paddle.Tensor:
    return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))


def _cache(rng: np.random.Generator, dtype: str, *shape: int) -> paddle.Tensor:
    """A random KV cache of ``shape`` ``[N, Hkv, bs, D]`` stored as ``dtype`` (int8: codes and row scales)."""
    values = rng.standard_normal(shape).astype(np.float32)
    return paddle.to_tensor(int8_cache.quantize(values)) if dtype == "int8" else paddle.to_tensor(values).astype(dtype)


def _rows(rng: np.random.Generator, block_size: int, case: str) -> list[tuple[int, int]]:
    if case == "decode":
        return [(int(s), 1) for s in rng.integers(0, 4 * block_size, size=37)]
    if case == "few-decode":   # a step of few decode rows: the long one split along its keys
        return [(int(rng.integers(129, 700)), 1), (int(rng.integers(0, 100)), 1)]
    if case == "prefill":
        return [(0, int(rng.integers(2, 3 * block_size)))]
    # ragged: decode rows, a chunk continuing a prompt past block boundaries, a fresh prompt
    return [(int(rng.integers(0, 70)), 1), (5, 1), (block_size + 3, 2 * block_size + 7), (0, 19)]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 2, 32), (32, 4, 128)])
@pytest.mark.parametrize("case", ["decode", "few-decode", "prefill", "ragged"])
@pytest.mark.parametrize(("cache_dtype", "round_queries"), [("float32", False), ("bfloat16", False),
                                                            ("bfloat16", True), ("int8", False), ("int8", True)])
def test_cpp_attention_matches_the_reference(cpp, block_size: int, heads: int, kv_heads: int, head_dim: int,
                                             case: str, cache_dtype: str, round_queries: bool) -> None:
    """A bfloat16 or int8 cache: both read the same stored values, widened to float32 (the reference
    by ``int8_cache.widen``; the C++ kernel applies an int8 row's scale to its scores and softmax
    weights instead), so the float32 tolerance holds. Rounded queries: both multiply the same rounded
    values (the C++ kernel on AMX tiles where built in, for head sizes of whole tiles), summed in
    another order; where the kernel has AMX, a prefill chunk's softmax weights are rounded to
    bfloat16 for the values' tiles as well: each weight moves by at most 2^-8 of itself, so the
    output by at most 2^-8 of the largest value, and on average far less."""
    rng = np.random.default_rng(block_size * 1000 + heads * 10 + len(case))
    attn = _step(rng, _rows(rng, block_size, case), block_size, heads, kv_heads)
    k_cache = _cache(rng, cache_dtype, NUM_BLOCKS, kv_heads, block_size, head_dim)
    v_cache = _cache(rng, cache_dtype, NUM_BLOCKS, kv_heads, block_size, head_dim)
    q = _random(rng, attn.num_tokens, heads, head_dim) * (1 / np.sqrt(head_dim))
    want = pa.attention_reference(q, k_cache, v_cache, attn, round_queries=round_queries).numpy()
    got = cpp["attention"](q, k_cache, v_cache, attn, round_queries=round_queries).numpy()
    if round_queries and "decode" not in case:
        stored = int8_cache.widen(v_cache) if cache_dtype == "int8" else v_cache.astype("float32")
        rounded_weights = 2.0 ** -8 * np.abs(stored.numpy()).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=rounded_weights + 2e-6)
        assert np.abs(got - want).mean() < 2.0 ** -10   # roundings that cancel (measured ~2^-12); a lost key: ~1e-2
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def _dense_windowed(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray,
                    window: int) -> np.ndarray:
    """Attention of one row's queries ``[n, H, D]`` at ``positions`` over its keys/values ``[L, Hkv, D]``,
    each query seeing keys p - window + 1 .. p, by definition."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    out = np.zeros_like(q)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1)
        for h in range(heads):
            scores = keys[lo:p + 1, h * kv_heads // heads] @ q[i, h]
            w = np.exp(scores - scores.max())
            out[i, h] = (w / w.sum()) @ values[lo:p + 1, h * kv_heads // heads]
    return out


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("case", ["decode", "few-decode", "prefill", "ragged"])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 130])
def test_a_sliding_window_hides_the_keys_before_it_in_both_variants(cpp, block_size: int, case: str,
                                                                     window: int) -> None:
    """Windows shorter and longer than a block, a split decode row's parts and prefill tiles: the C++
    kernel (which skips the blocks before a tile's window) and the reference equal the definition."""
    rng = np.random.default_rng(block_size + window + len(case))
    heads, kv_heads, head_dim = 8, 2, 32
    attn = _step(rng, _rows(rng, block_size, case), block_size, heads, kv_heads)
    k_cache, v_cache = (_cache(rng, "float32", NUM_BLOCKS, kv_heads, block_size, head_dim) for _ in range(2))
    q = _random(rng, attn.num_tokens, heads, head_dim) * (1 / np.sqrt(head_dim))
    got = cpp["attention"](q, k_cache, v_cache, attn, window=window).numpy()
    reference = pa.attention_reference(q, k_cache, v_cache, attn, window=window).numpy()
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=2e-6)
    begins = np.concatenate([[0], np.cumsum(attn.num_new_tokens)])
    by_slot = [cache.numpy().transpose(0, 2, 1, 3).reshape(-1, kv_heads, head_dim) for cache in (k_cache, v_cache)]
    for r in range(len(attn.starts)):   # each row by the definition, over its own blocks
        length = int(attn.context_lens[r])
        slots = attn.block_tables[r][np.arange(length) // block_size] * block_size + np.arange(length) % block_size
        tokens = slice(int(begins[r]), int(begins[r + 1]))
        want = _dense_windowed(q.numpy()[tokens], by_slot[0][slots], by_slot[1][slots], attn.positions[tokens], window)
        np.testing.assert_allclose(got[tokens], want, rtol=1e-4, atol=1e-5)
    if window < 40:
        assert not np.allclose(got, cpp["attention"](q, k_cache, v_cache, attn).numpy(), atol=1e-3)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [[(700, 1)], [(280 + 7 * i, 1) for i in range(8)]], ids=["split", "8-rows"])
def test_decode_rows_give_the_same_bits_on_any_thread_count(cpp, cache_dtype: str, rows: list) -> None:
    """One decode row of 700 keys (split into parts of 128 keys whatever the thread count), and a
    step of 8 rows (a few thousand query-key pairs each: spread over the threads, not split)."""
    ops = native.load_native(CpuPlatform().capabilities)
    rng = np.random.default_rng(3)
    attn = _step(rng, rows, 16, 9, 3)
    k_cache, v_cache = (_cache(rng, cache_dtype, NUM_BLOCKS, 3, 16, 64) for _ in range(2))
    q = _random(rng, len(rows), 9, 64) * (1 / np.sqrt(64))
    one, two, three = (ops.fd_paged_attention(q, k_cache, v_cache, attn.row_tables, attn.row_starts, attn.row_lens,
                                              1.0, False, threads, 0).numpy() for threads in (1, 2, 3))
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, three)
    want = pa.attention_reference(q, k_cache, v_cache, attn).numpy()
    np.testing.assert_allclose(one.reshape(want.shape), want, rtol=1e-5, atol=2e-6)


def test_rounded_queries_change_the_result(cpp) -> None:
    """The rounding is really applied (by both variants): the outputs move by about bfloat16's step."""
    rng = np.random.default_rng(7)
    attn = _step(rng, _rows(rng, 16, "ragged"), 16, 9, 3)
    k_cache, v_cache = (_random(rng, NUM_BLOCKS, 3, 16, 64).astype("bfloat16") for _ in range(2))
    q = _random(rng, attn.num_tokens, 9, 64)
    for variant in (pa.attention_reference, cpp["attention"]):
        exact, rounded = (variant(q, k_cache, v_cache, attn, round_queries=r).numpy() for r in (False, True))
        assert 1e-4 < np.abs(exact - rounded).max() < 5e-2


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 32)])
def test_cpp_rope_and_kv_write_match_the_reference(cpp, block_size: int, heads: int, kv_heads: int,
                                                   head_dim: int) -> None:
    rng = np.random.default_rng(block_size + heads)
    attn = _step(rng, _rows(rng, block_size, "ragged"), block_size, heads, kv_heads)
    qkv = _random(rng, attn.num_tokens, heads + 2 * kv_heads, head_dim)
    cos, sin = _random(rng, 512, head_dim), _random(rng, 512, head_dim)
    caches = {}
    for name, variant in (("reference", pa.rope_write_kv_reference), ("cpp", cpp["rope_write_kv"])):
        k_cache = paddle.zeros([NUM_BLOCKS, kv_heads, block_size, head_dim])
        v_cache = paddle.zeros([NUM_BLOCKS, kv_heads, block_size, head_dim])
        q = variant(cos, sin, attn, heads)(qkv, k_cache, v_cache)
        caches[name] = (q.numpy(), k_cache.numpy(), v_cache.numpy())
    for got, want in zip(caches["cpp"], caches["reference"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    written = np.abs(caches["cpp"][1]).sum(axis=(1, 2, 3)) > 0
    assert written.sum() == len({int(s) // block_size for s in attn.slot_mapping})   # only the step's blocks


def test_cpp_kv_write_into_a_bfloat16_cache_rounds_to_nearest_even(cpp) -> None:
    """The values stored are Paddle's own float32 -> bfloat16 cast (round to nearest even) of what the
    float32 cache gets; q is unaffected."""
    rng = np.random.default_rng(5)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    attn = _step(rng, _rows(rng, block_size, "ragged"), block_size, heads, kv_heads)
    qkv = _random(rng, attn.num_tokens, heads + 2 * kv_heads, head_dim)
    cos, sin = _random(rng, 512, head_dim), _random(rng, 512, head_dim)
    shape = [NUM_BLOCKS, kv_heads, block_size, head_dim]
    results = {}
    for dtype in ("float32", "bfloat16"):
        k_cache, v_cache = paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)
        q = cpp["rope_write_kv"](cos, sin, attn, heads)(qkv, k_cache, v_cache)
        results[dtype] = (q, k_cache, v_cache)
    np.testing.assert_array_equal(results["bfloat16"][0].numpy(), results["float32"][0].numpy())
    for wide, narrow in zip(results["float32"][1:], results["bfloat16"][1:], strict=True):
        np.testing.assert_array_equal(narrow.astype("float32").numpy(),
                                      wide.astype("bfloat16").astype("float32").numpy())


@pytest.mark.parametrize("tokens", [1, 7, 300])   # 300 rows: spread over threads
@pytest.mark.parametrize("with_residual", [False, True])
def test_cpp_rms_norm_matches_the_portable_one(cpp, tokens: int, with_residual: bool) -> None:
    rng = np.random.default_rng(tokens)
    x, weight = _random(rng, tokens, 576), _random(rng, 576)
    residual = _random(rng, tokens, 576) if with_residual else None
    got = cpp["rms_norm"](x, weight, 1e-5, residual)
    want = rms_norm.rms_norm_portable(x, weight, 1e-5, residual)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 5, 400])   # 400 rows: spread over threads
def test_cpp_swiglu_matches_paddles(cpp, tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    gate_up = rng.standard_normal((tokens, 2 * 1536)).astype(np.float32) * 4
    gate_up[0, :6] = [-120.0, -88.5, -30.0, 0.0, 30.0, 95.0]   # exp's clamps and both tails
    x = paddle.to_tensor(gate_up)
    got, want = cpp["swiglu"](x).numpy(), paddle.nn.functional.swiglu(x).numpy()
    assert got.shape == (tokens, 1536)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 64, 700])   # one packing serves every row count
@pytest.mark.parametrize("transposed", [False, True])
def test_packed_linear_matches_paddles(cpp, rows: int, transposed: bool) -> None:
    rng = np.random.default_rng(rows)
    weight = _random(rng, *((320, 96) if transposed else (96, 320)))   # [in, out], or [out, in]
    x, bias = _random(rng, rows, 96), _random(rng, 320)
    prepared = cpp["linear"].prepare(weight, transposed=transposed)
    want = (x @ (weight.T if transposed else weight) + bias).numpy()
    np.testing.assert_allclose(cpp["linear"](x, prepared, bias).numpy(), want, rtol=1e-5, atol=1e-5)
    assert cpp["linear"](x[:0], prepared).shape == [0, 320]


def test_a_weight_that_is_not_float32_is_left_to_the_portable_linear(cpp) -> None:
    weight = paddle.ones([8, 4], dtype="float64")   # bfloat16 models take this path too
    prepared = cpp["linear"].prepare(weight)
    out = cpp["linear"](paddle.ones([3, 8], dtype="float64"), prepared)
    assert out.dtype == paddle.float64 and float(out[0, 0]) == 8.0


def test_the_start_up_line_names_the_cpp_kernels_or_why_not(cpp) -> None:
    line = select_kernels(CpuPlatform().capabilities).describe()
    assert all(f"{op}=cpp" in line for op in ("rms_norm", "rope_write_kv", "swiglu", "attention"))
    assert "linear=mkl_packed" in line
    portable = select_kernels({"paged_attention"}).describe()
    assert "attention=reference (cpp needs cpp_kernels)" in portable
    assert "rms_norm=portable (cpp needs cpp_kernels, fused needs fused_rms_norm)" in portable


def test_a_failed_build_falls_back_to_the_reference_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native, "_loaded", {})
    kernels = select_kernels({"paged_attention", "cpp_kernels"})
    assert kernels.reads_gather_inputs
    assert "attention=reference (cpp: no C++ compiler on PATH" in kernels.describe()


def test_every_openmp_entry_point_binds_to_intels_runtime(cpp) -> None:
    """libgomp is in the process too (via Paddle): an OpenMP entry point libiomp5 lacks (e.g. GCC's
    nonmonotonic dynamic loop) would bind to libgomp, whose loop does not know iomp's team, so
    every thread would run every iteration. Versioned imports bind to libiomp5's definitions."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    library = next(native.cache_dir(native.isa_flags(CpuPlatform().capabilities)).glob("**/*.so"))
    imported = subprocess.run([nm, "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                              check=True).stdout.split()
    openmp = [symbol for symbol in imported if symbol.startswith(("GOMP_", "omp_", "__kmpc"))]
    exported = subprocess.run([nm, "-D", "--defined-only", str(native.paddle_libs() / "libiomp5.so")],
                              capture_output=True, text=True, check=True).stdout.replace("@@", "@").split()
    assert openmp, "the kernels use OpenMP"
    assert all(symbol.endswith("@VERSION") and symbol in exported for symbol in openmp), openmp


def test_isa_flags_follow_the_declared_features_only() -> None:
    assert native.isa_flags({"avx2", "fma"}) == ("-mavx2", "-mfma")
    assert "-mavx512f" in native.isa_flags({"avx2", "fma", "avx512f"})
    assert native.isa_flags({"avx512f"}) == ()     # never more than what is declared together
    assert native.isa_flags({"avx2", "fma", "avx512f", "amx_bf16"})[-2:] == ("-mamx-tile", "-mamx-bf16")
    assert not any("amx" in flag for flag in native.isa_flags({"avx2", "fma", "amx_bf16"}))
    # VNNI (quant_linear.cc's int8 dot products): the EVEX form needs avx512vl declared with it
    assert (native.isa_flags({"avx2", "fma", "avx512f", "avx512vl", "avx512_vnni"})[-2:]
            == ("-mavx512vl", "-mavx512vnni"))
    assert not any("vnni" in flag for flag in native.isa_flags({"avx2", "fma", "avx512f", "avx512_vnni"}))
    assert native.isa_flags({"avx2", "fma", "avx_vnni"}) == ("-mavx2", "-mfma", "-mavxvnni")
    assert native.isa_flags({"avx_vnni"}) == ()
    # vdpbf16ps (bf16_linear.cc): only where the platform declares the dot products fast, never beside AMX's tiles
    bf16 = {"avx2", "fma", "avx512f", "avx512_bf16"}
    assert native.isa_flags(bf16 | {"bf16_dot_products"})[-1] == "-mavx512bf16"
    assert "-mavx512bf16" not in native.isa_flags(bf16)
    assert "-mavx512bf16" not in native.isa_flags({"avx2", "fma", "avx512_bf16", "bf16_dot_products"})
    assert "-mavx512bf16" not in native.isa_flags(bf16 | {"bf16_dot_products", "amx_bf16"})
    assert native.cache_dir(("-mavx2", "-mfma")) != native.cache_dir(())



def test_cpp_kv_write_into_an_int8_cache_stores_codes_and_row_scales(cpp) -> None:
    """Each row the float32 cache gets is stored as ``int8_cache.quantize`` defines it, bit for bit
    (codes and scales; untouched rows stay zero), rows of very different sizes among them; q is
    unaffected, and the stored values are within half a step of the float32 ones."""
    rng = np.random.default_rng(6)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    attn = _step(rng, _rows(rng, block_size, "ragged"), block_size, heads, kv_heads)
    width = heads + 2 * kv_heads
    qkv = paddle.to_tensor((rng.standard_normal((attn.num_tokens, width, head_dim))
                            * 10.0 ** rng.uniform(-3, 2, (attn.num_tokens, width, 1))).astype(np.float32))
    cos, sin = _random(rng, 512, head_dim), _random(rng, 512, head_dim)
    shape = [NUM_BLOCKS, kv_heads, block_size, head_dim]
    wide = [paddle.zeros(shape), paddle.zeros(shape)]
    narrow = [paddle.zeros([*shape[:3], head_dim + int8_cache.ROW_EXTRA], dtype="int8") for _ in range(2)]
    q_wide = cpp["rope_write_kv"](cos, sin, attn, heads)(qkv, *wide)
    q_narrow = cpp["rope_write_kv"](cos, sin, attn, heads)(qkv, *narrow)
    np.testing.assert_array_equal(q_narrow.numpy(), q_wide.numpy())
    for float_cache, codes in zip(wide, narrow, strict=True):
        np.testing.assert_array_equal(codes.numpy(), int8_cache.quantize(float_cache.numpy()))
        values, stored = float_cache.numpy(), int8_cache.widen(codes).numpy()
        step = np.abs(values).max(axis=-1, keepdims=True) / 127
        assert (np.abs(stored - values) <= 0.5 * step * (1 + 1e-5)).all()
        assert (values != 0).any()


def test_a_later_start_loads_the_built_library_without_starting_paddle_s_build(cpp) -> None:
    """With the ``built`` marker in place, a new process gets the ops even where Paddle's ``load``
    (which starts a build process every time) would fail."""
    folder = native.cache_dir(native.isa_flags(CpuPlatform().capabilities))
    assert (folder / "built").exists()
    program = ("import paddle.utils.cpp_extension as ext\n"
               "def refuse(*args, **kwargs): raise RuntimeError('load() was called')\n"
               "ext.load = refuse\n"
               "from fd_kernels import native\n"
               "from fd_plugins.platforms.cpu import CpuPlatform\n"
               "ops = native.load_native(CpuPlatform().capabilities)\n"
               "print(callable(ops.fd_paged_attention))\n")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]


#: Packs a [576, 960] weight (MKL's buffer: ~5x its bytes) into memory that held written and freed
#: data, under the heap tuning the cpu platform applies, four times: resident, allocated, float32 bytes.
_PACK_INTO_USED_MEMORY = """
import json, paddle
from fd_core.runner.memory import resident_bytes
from fd_kernels import native
from fd_plugins.platforms.cpu import CpuPlatform
from fd_plugins.platforms.host_tuning import keep_freed_memory
keep_freed_memory()
linear = native.prepare_linear(CpuPlatform().capabilities)
figures = []
for _ in range(4):
    used = paddle.ones([64 << 18])   # 64 MiB written, then freed: the heap keeps it for the next buffer
    del used
    packed = linear.prepare(paddle.ones([576, 960]))
    figures.append([resident_bytes([packed.data]), packed.data.shape[0], 576 * 960 * 4])
print(json.dumps(figures))
"""


def test_a_packed_weight_holds_only_the_pages_mkl_writes(cpp) -> None:
    """MKL sizes a packed weight for its largest case and writes part of it; the rest must not keep
    the stale pages the memory held before (they stayed resident beside every packed weight)."""
    run = subprocess.run([sys.executable, "-c", _PACK_INTO_USED_MEMORY], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for resident, allocated, dense in json.loads(run.stdout):
        assert allocated > 3 * dense   # the case that matters
        # MKL's layout pads what it writes a little (more on huge pages): far below the allocation
        assert resident <= 1.5 * dense, (resident, allocated, dense)


@pytest.mark.parametrize(("omp_num_threads", "expected"), [(None, "usable"), ("1", 1), ("999", "usable"),
                                                          ("0", "usable"), ("four", "usable")])
def test_the_kernels_use_the_platform_s_thread_count_within_the_usable_cpus(monkeypatch, omp_num_threads, expected):
    """The cpu platform's ``num_threads`` reaches the kernels as ``OMP_NUM_THREADS`` (as it reaches
    MKL); they ran on every usable CPU whatever it said."""
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    usable = len(os.sched_getaffinity(0))
    assert native._threads() == (usable if expected == "usable" else expected)

