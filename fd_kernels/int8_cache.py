"""The int8 KV cache's layout, in Python: for tests and the reference kernels.

Per block and KV head the cache holds ``block_size`` rows of ``head_dim`` int8 codes, then
``block_size`` float32 scales; row ``r``'s values are its codes times scale ``r``, the row's largest
magnitude / 127 (codes round to nearest even: ``rint(x / scale)``). Its tensor is int8
``[num_blocks, num_kv_heads, block_size, head_dim + ROW_EXTRA]``: the shape sizes a block's bytes,
while inside a block and head all codes come first, so that rows stay ``head_dim`` apart as in a
float cache. The C++ RoPE + KV write (``csrc/rope_kv.cc``) writes this layout and the C++
attention reads it in place; :func:`quantize` and :func:`widen` are their definition.
"""

from __future__ import annotations

import numpy as np
import paddle

#: Bytes a row's float32 scale adds to it in the tensor's shape.
ROW_EXTRA: int = 4


def quantize(values: np.ndarray) -> np.ndarray:
    """float32 ``[N, H, bs, D]`` as an int8 cache ``[N, H, bs, D + ROW_EXTRA]`` (the layout above)."""
    values = np.asarray(values, dtype=np.float32)
    n, h, bs, d = values.shape
    scales = np.abs(values).max(axis=-1) / np.float32(127)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    codes = np.where(scales[..., None] > 0, np.rint(values / safe), 0).astype(np.int8)
    region = np.concatenate([codes.reshape(n, h, bs * d).view(np.uint8),
                             scales.astype("<f4").reshape(n, h, bs).view(np.uint8)], axis=-1)
    return region.view(np.int8).reshape(n, h, bs, d + ROW_EXTRA)


def widen(cache: paddle.Tensor) -> paddle.Tensor:
    """An int8 cache's values as float32 ``[N, H, bs, D]``: each row's codes times its scale."""
    n, h, bs, width = cache.shape
    d = width - ROW_EXTRA
    region = cache.numpy().reshape(n, h, bs * width)
    codes = region[:, :, :bs * d].reshape(n, h, bs, d).astype(np.float32)
    scales = np.ascontiguousarray(region[:, :, bs * d:]).view("<f4").reshape(n, h, bs, 1)
    return paddle.to_tensor(codes * scales)
