"""Read and write whole KV blocks of the runner's paged cache as byte buffers, without copying.

A block's payload is ``2 * num_layers`` buffers: K then V of layer 0, K then V of layer 1, ...;
each is the block's slice ``[num_kv_heads, block_size, head_dim]`` of that layer's tensor (see
:mod:`fd_core.runner.kv_cache`), contiguous because the block index is the outer dimension.
The views share memory with the Paddle tensors (DLPack), so a connector may send straight from
them and the receiving side copies each buffer once, into its own block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fd_core.runner.kv_cache import LayerKVCache


class KVBlockViews:
    """NumPy views of every layer's K and V cache tensors (host memory only)."""

    def __init__(self, caches: Sequence[LayerKVCache]) -> None:
        self._arrays = [_host_array(tensor) for layer in caches for tensor in (layer.key, layer.value)]
        first = self._arrays[0]
        self.num_blocks = first.shape[0]
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self._dtype_name = "bfloat16" if _is_bfloat16(caches[0].key) else str(first.dtype)
        self.bytes_per_block = sum(a[0].nbytes for a in self._arrays)

    @property
    def layout(self) -> str:
        """What must be equal on both sides for blocks to fit: buffers, their shape and dtype."""
        heads, block_size, head_dim = self.block_shape
        return (f"buffers={len(self._arrays)},kv_heads={heads},block_size={block_size},head_dim={head_dim},"
                f"dtype={self._dtype_name}")

    def read(self, block_id: int) -> list[memoryview]:
        """The block's buffers, sharing memory with the cache (valid while the block is held)."""
        return [memoryview(a[block_id]).cast("B") for a in self._arrays]

    def write(self, block_id: int, buffers: Sequence[memoryview | bytes]) -> None:
        """Copy a received block into ``block_id``; raises ValueError when its shape does not fit."""
        if len(buffers) != len(self._arrays):
            raise ValueError(f"a block has {len(self._arrays)} buffers here, got {len(buffers)}")
        for array, buffer in zip(self._arrays, buffers, strict=True):
            target = array[block_id]
            source = np.frombuffer(buffer, dtype=self.dtype)
            if source.size != target.size:
                raise ValueError(f"a block buffer has {target.nbytes} bytes here, got {source.nbytes}")
            target[...] = source.reshape(target.shape)


def _is_bfloat16(tensor: object) -> bool:
    import paddle

    return tensor.dtype == paddle.bfloat16


def _host_array(tensor: object) -> np.ndarray:
    """A NumPy view of a cache tensor; bfloat16 (which NumPy lacks) as its uint16 bit patterns."""
    import paddle

    return np.from_dlpack(tensor.view(paddle.uint16) if _is_bfloat16(tensor) else tensor)
