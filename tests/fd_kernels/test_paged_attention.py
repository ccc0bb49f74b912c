"""The reference paged-attention kernel against plain numpy attention over contiguous K/V."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_kernels import paged_attention as pa

NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 24, 2, 6, 8


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA attention of ``q [n, H, D]`` at positions ``start..`` over ``k, v [ctx, Hkv, D]``."""
    n, group = q.shape[0], HEADS // KV_HEADS
    out = np.empty_like(q)
    for h in range(HEADS):
        scores = q[:, h] @ k[:, h // group].T / np.sqrt(HEAD_DIM)        # [n, ctx]
        scores[np.arange(k.shape[0])[None, :] > start + np.arange(n)[:, None]] = -np.inf
        out[:, h] = _softmax(scores) @ v[:, h // group]
    return out


def _tensors(*arrays: np.ndarray) -> list[paddle.Tensor]:
    return [paddle.to_tensor(a) for a in arrays]


class _Cache:
    """A cache filled through write_kv_cache for sequences with given block tables."""

    def __init__(self, block_size: int, seqs: dict[str, tuple[int, list[int]]], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        shape = [NUM_BLOCKS, KV_HEADS, block_size, HEAD_DIM]
        self.block_size = block_size
        self.k, self.v = paddle.zeros(shape), paddle.zeros(shape)
        self.kv = {}
        for name, (length, table) in seqs.items():
            k = rng.standard_normal((length, KV_HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((length, KV_HEADS, HEAD_DIM)).astype(np.float32)
            self.kv[name] = (k, v)
            pos = np.arange(length)
            slots = np.asarray(table)[pos // block_size] * block_size + pos % block_size
            index = pa.write_index(slots, block_size, KV_HEADS)
            pa.write_kv_cache(*_tensors(k, v), self.k, self.v, paddle.to_tensor(index))


@pytest.mark.parametrize("block_size", [4, 16])
def test_write_lands_in_the_documented_layout(block_size: int) -> None:
    table = [7, 2, 19, 11, 5]
    length = 3 * block_size + 1
    cache = _Cache(block_size, {"a": (length, table)})
    k = cache.kv["a"][0]
    got = cache.k.numpy()
    for pos in range(length):
        block, offset = table[pos // block_size], pos % block_size
        np.testing.assert_array_equal(got[block, :, offset], k[pos])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(table[:-(-length // block_size)]))
    assert not got[untouched].any()


def test_write_does_not_reallocate_the_cache() -> None:
    shape = [NUM_BLOCKS, KV_HEADS, 4, HEAD_DIM]
    k_cache, v_cache = paddle.zeros(shape), paddle.zeros(shape)
    pointers = (k_cache.data_ptr(), v_cache.data_ptr())
    new = paddle.ones([3, KV_HEADS, HEAD_DIM])
    pa.write_kv_cache(new, new * 2, k_cache, v_cache,
                      paddle.to_tensor(pa.write_index(np.array([9, 10, 40]), 4, KV_HEADS)))
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == pointers
    assert float(k_cache.sum()) == 3 * KV_HEADS * HEAD_DIM
    assert float(v_cache[10, :, 0].sum()) == 2 * KV_HEADS * HEAD_DIM


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_rows_batched_match_reference(block_size: int) -> None:
    rng = np.random.default_rng(1)
    blocks = rng.permutation(NUM_BLOCKS).tolist()
    lengths = {"a": 1, "b": block_size, "c": 2 * block_size + 3, "d": 5}
    seqs = {}
    for name, n in lengths.items():
        seqs[name] = (n, [blocks.pop() for _ in range(-(-n // block_size))])
    cache = _Cache(block_size, seqs)
    width = max(len(t) for _, t in seqs.values())
    tables = np.array([t + [0] * (width - len(t)) for _, t in seqs.values()])
    context = np.array([n for n, _ in seqs.values()])
    q = rng.standard_normal((len(seqs), HEADS, HEAD_DIM)).astype(np.float32)
    out = pa.decode_attention(paddle.to_tensor(q), cache.k, cache.v,
                              paddle.to_tensor(pa.gather_index(tables, KV_HEADS)),
                              paddle.to_tensor(pa.decode_mask(context, width * block_size, HEADS)),
                              1 / np.sqrt(HEAD_DIM)).numpy()
    for i, (name, (n, _)) in enumerate(seqs.items()):
        k, v = cache.kv[name]
        np.testing.assert_allclose(out[i], _reference(q[i:i + 1], k, v, n - 1)[0], atol=1e-5)


@pytest.mark.parametrize(("start", "n"), [(0, 9), (5, 7), (16, 1), (13, 20)])
def test_prefill_chunk_matches_reference(start: int, n: int) -> None:
    block_size, table = 4, [20, 3, 9, 14, 1, 8, 22, 0, 5]
    cache = _Cache(block_size, {"a": (start + n, table)})
    k, v = cache.kv["a"]
    q = np.random.default_rng(2).standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)
    blocks = -(-(start + n) // block_size)
    out = pa.prefill_attention(paddle.to_tensor(q), cache.k, cache.v,
                               paddle.to_tensor(pa.gather_index(np.array([table[:blocks]]), KV_HEADS)),
                               paddle.to_tensor(pa.prefill_mask(start, n, blocks * block_size)),
                               1 / np.sqrt(HEAD_DIM)).numpy()
    np.testing.assert_allclose(out, _reference(q, k, v, start), atol=1e-5)


def test_mixed_batch_splits_decode_and_prefill_rows() -> None:
    block_size = 4
    seqs = {"d1": (6, [4, 17]), "d2": (9, [2, 12, 6]), "p": (11, [21, 10, 15])}
    cache = _Cache(block_size, seqs)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2 + 4, HEADS, HEAD_DIM)).astype(np.float32)  # p computes 7..10
    chunk = pa.PrefillChunk(
        begin=2, end=6,
        gather_index=paddle.to_tensor(pa.gather_index(np.array([[21, 10, 15]]), KV_HEADS)),
        mask=paddle.to_tensor(pa.prefill_mask(7, 4, 12)))
    decode_index = paddle.to_tensor(pa.gather_index(np.array([[4, 17, 0], [2, 12, 6]]), KV_HEADS))
    decode_mask = paddle.to_tensor(pa.decode_mask(np.array([6, 9]), 12, HEADS))
    scale = 1 / np.sqrt(HEAD_DIM)
    out = pa.paged_attention(
        paddle.to_tensor(q), cache.k, cache.v, num_decode=2, decode_index=decode_index,
        decode_mask=decode_mask, prefill=[chunk], scale=scale).numpy()
    np.testing.assert_allclose(out[0], _reference(q[0:1], *cache.kv["d1"], 5)[0], atol=1e-5)
    np.testing.assert_allclose(out[1], _reference(q[1:2], *cache.kv["d2"], 8)[0], atol=1e-5)
    np.testing.assert_allclose(out[2:], _reference(q[2:], *cache.kv["p"], 7), atol=1e-5)
