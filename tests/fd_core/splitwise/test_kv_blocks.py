"""Whole-block byte views of the paged cache, for float32, bfloat16 and int8 caches (NumPy has no
bfloat16: its blocks travel as their 16-bit patterns, and the layout still says bfloat16; an int8
block's row scales travel inside it)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.runner.kv_cache import LayerKVCache
from fd_core.splitwise.kv_blocks import KVBlockViews
from fd_kernels import int8_cache


def _caches(dtype: str, seed: int) -> list[LayerKVCache]:
    rng = np.random.default_rng(seed)

    def tensor() -> paddle.Tensor:
        values = rng.standard_normal((6, 2, 4, 8)).astype(np.float32)
        if dtype == "int8":
            return paddle.to_tensor(int8_cache.quantize(values))
        return paddle.to_tensor(values).astype(dtype)

    return [LayerKVCache(tensor(), tensor()) for _ in range(3)]


@pytest.mark.parametrize(("dtype", "row_bytes"), [("float32", 8 * 4), ("bfloat16", 8 * 2), ("int8", 8 + 4)])
def test_a_block_read_on_one_side_and_written_on_the_other_lands_exactly(dtype: str, row_bytes: int) -> None:
    source, target = _caches(dtype, 0), _caches(dtype, 1)
    sender, receiver = KVBlockViews(source), KVBlockViews(target)
    assert sender.layout == receiver.layout and sender.layout.endswith(f"dtype={dtype}")
    assert sender.bytes_per_block == 3 * 2 * 2 * 4 * row_bytes
    receiver.write(5, [bytes(b) for b in sender.read(2)])
    for ours, theirs in zip(target, source, strict=True):
        for mine, sent in ((ours.key, theirs.key), (ours.value, theirs.value)):
            np.testing.assert_array_equal(mine[5].astype("float32").numpy(), sent[2].astype("float32").numpy())
    assert not np.array_equal(target[0].key[4].astype("float32").numpy(), source[0].key[4].astype("float32").numpy())
    with pytest.raises(ValueError, match="bytes here"):
        receiver.write(0, [b"x" * 12] * 6)


def test_layouts_of_other_dtypes_differ() -> None:
    layouts = {KVBlockViews(_caches(dtype, 0)).layout for dtype in ("float32", "bfloat16", "int8")}
    assert len(layouts) == 3
