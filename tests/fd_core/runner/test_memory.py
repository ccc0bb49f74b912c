"""Resident memory by part: resident pages under arrays, the arrays a model holds (each weight once),
and the load-time arrays freed before the KV pool is allocated."""

from __future__ import annotations

import gc
import math
import mmap
import weakref

import numpy as np
import pytest

from fd_core.model.llama import weight_shapes
from fd_core.runner.kv_cache import LayerKVCache
from fd_core.runner.memory import MemoryUsage, held_arrays, process_resident_bytes, resident_bytes
from fd_core.runner.model_runner import ModelRunner
from fd_plugins.models.llama import LlamaFamily
from tests.fd_core.model.tiny_llama import GreedySampler, random_weights, tiny_arch

PAGE = mmap.PAGESIZE


def test_resident_bytes_count_the_pages_written_once_each():
    region = mmap.mmap(-1, 16 * PAGE)   # fresh anonymous pages: none resident until written
    pages = np.frombuffer(region, np.uint8).reshape(16, PAGE)
    assert resident_bytes([pages]) == 0
    pages[[0, 5, 9], 7] = 1
    assert resident_bytes([pages]) == 3 * PAGE
    # a view of the same pages, and an array ending inside a page another begins in: each page once
    assert resident_bytes([pages, pages[4:10], pages[:6].reshape(-1)[100:PAGE * 5 + 8]]) == 3 * PAGE
    del pages
    region.close()


@pytest.mark.parametrize("tie", [False, True])
def test_the_model_holds_each_weight_once_and_the_sources_go_before_the_pool(tie):
    arch = tiny_arch(tie=tie)
    weights = random_weights(arch)
    sources = [weakref.ref(array) for array in weights.values()]
    pools_before = _kv_caches_alive()
    pools_at_release: list[int] = []

    def release() -> None:
        pools_at_release.append(_kv_caches_alive())
        weights.clear()
        gc.collect()

    runner = ModelRunner(LlamaFamily(), arch, weights, num_blocks=8, block_size=16, sampler=GreedySampler(),
                         release_weights=release)
    gc.collect()
    assert pools_at_release == [pools_before]          # released once, before the pool existed
    assert _kv_caches_alive() == pools_before + arch.num_hidden_layers
    assert not [ref for ref in sources if ref() is not None]   # nothing kept a load-time array
    # the portable kernels hold each float32 weight once (a tied head reads the embedding itself),
    # beside the RoPE tables
    held = sum(_nbytes(array) for array in held_arrays(runner.model))
    rope = sum(_nbytes(t) for t in (runner.model.rope_cos, runner.model.rope_sin))
    assert held == 4 * sum(math.prod(shape) for shape in weight_shapes(arch).values()) + rope


def test_the_parts_add_up_to_the_resident_set():
    resident, peak = process_resident_bytes()
    assert 0 < resident <= peak
    usage = MemoryUsage(weights=100 << 20, kv_cache=50 << 20, resident=resident, peak_resident=peak)
    figures = usage.as_dict()
    assert figures["weights"] + figures["kv_cache"] + figures["runtime"] == max(resident, 150 << 20)
    assert usage.describe().endswith(f"weights 100 MiB as the kernels hold them, KV pool 50 MiB, "
                                     f"runtime {usage.runtime >> 20:,} MiB")


def _kv_caches_alive() -> int:
    return sum(type(obj) is LayerKVCache for obj in gc.get_objects())


def _nbytes(array) -> int:
    return array.nbytes if isinstance(array, np.ndarray) else math.prod(array.shape) * array.element_size()
