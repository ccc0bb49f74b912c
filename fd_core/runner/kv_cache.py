"""Allocation of the paged KV cache: one K and one V tensor per layer.

Each tensor is ``[num_blocks, num_kv_heads, block_size, head_dim]`` (the layout
:mod:`fd_kernels.paged_attention` reads; see its docstring for why heads come before
positions). Block ``b`` of every layer together holds the K/V of ``block_size`` token
positions of one request, so a block id from the resource manager indexes all layers.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import paddle

from fd_kernels.int8_cache import ROW_EXTRA

if TYPE_CHECKING:
    from fd_core.contracts.architecture import ModelShape

#: Bytes per element of the cache dtypes we allocate.
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def _row_width(arch: ModelShape, dtype: str) -> int:
    """Elements of a cache row: head_dim, and an int8 cache's scale (``fd_kernels.int8_cache``)."""
    return arch.head_dim + (ROW_EXTRA if dtype == "int8" else 0)


@dataclass(frozen=True, slots=True)
class LayerKVCache:
    """The K and V cache tensors of one layer, updated in place by the attention kernel."""

    key: paddle.Tensor    # [num_blocks, num_kv_heads, block_size, head_dim] (int8: head_dim + 4, fd_kernels.int8_cache)
    value: paddle.Tensor  # same shape and dtype as key


def _check_dtype(dtype: str) -> None:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"KV cache dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_BYTES)}")


def kv_cache_bytes_per_block(arch: ModelShape, block_size: int, dtype: str = "float32") -> int:
    """Bytes one block takes across all layers, K and V: what the platform divides free memory by."""
    _check_dtype(dtype)
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * _row_width(arch, dtype)
    return per_token * block_size * _DTYPE_BYTES[dtype]


def allocate_kv_caches(arch: ModelShape, *, num_blocks: int, block_size: int,
                       dtype: str = "float32") -> list[LayerKVCache]:
    """Zero-filled caches for every layer of ``arch`` on paddle's current device. In host memory the
    zeros are written at start-up by a thread per usable core: that first write faults the pool's
    pages in, which would otherwise land on the first workload, and faults run in parallel."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    _check_dtype(dtype)
    shape = [num_blocks, arch.num_key_value_heads, block_size, _row_width(arch, dtype)]
    tensors = [paddle.empty(shape, dtype=dtype) for _ in range(2 * arch.num_hidden_layers)]
    _zero(tensors, _DTYPE_BYTES[dtype])
    return [LayerKVCache(key=tensors[i], value=tensors[i + 1]) for i in range(0, len(tensors), 2)]


def _zero(tensors: list[paddle.Tensor], element_bytes: int) -> None:
    host = [t for t in tensors if t.place.is_cpu_place()]
    for tensor in tensors:
        if not tensor.place.is_cpu_place():
            tensor.fill_(0)

    def write_zeros(tensor: paddle.Tensor) -> None:   # ctypes lets go of the GIL for the call
        ctypes.memset(tensor.data_ptr(), 0, tensor.numel().item() * element_bytes)

    with ThreadPoolExecutor(max_workers=min(len(host), len(os.sched_getaffinity(0))) or 1) as pool:
        list(pool.map(write_zeros, host))
