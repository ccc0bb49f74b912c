"""Paged attention over a block-structured KV cache: the Paddle reference implementation.

Cache layout (one K and one V tensor per layer)::

    [num_blocks, num_kv_heads, block_size, head_dim]

so the ``block_size`` keys of one head in one block are one contiguous ``block_size *
head_dim`` run. Reading a request's context is then a single row gather over the cache
viewed as ``[num_blocks * num_kv_heads, block_size * head_dim]``, and it lands directly in
``[rows, num_kv_heads, context, head_dim]`` order, ready for a batched matmul with no
transpose (a transposing gather measured ~10x slower on CPU). A token at slot
``block * block_size + offset`` is written, per head ``h``, to row
``(block * num_kv_heads + h) * block_size + offset`` of the cache viewed as
``[-1, head_dim]``.

The host-side helpers (``*_index``, ``*_mask``; numpy in, numpy out) turn block tables and
positions into those indices and into additive masks once per step; the device functions
run once per layer and never loop over tokens. Decode rows (one query each) are batched
into one gather and two matmuls; prefill chunks (several queries, causal) run one at a time.
The metadata builder cuts a long row into chunks of at most :data:`PREFILL_CHUNK` queries, each
reading only the keys up to its last query, so the masked upper triangle of a long prompt's
scores is mostly never computed (see :data:`PREFILL_CHUNK` for the measurement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import paddle

from fd_kernels import int8_cache

#: Additive mask value for positions a query must not see.
MASKED: float = float("-inf")

#: Most queries in one prefill chunk. Chunk ``i`` of a row starting at 0 sees ``(i + 1) * 128``
#: keys, so a 512-token prompt computes 62.5% of the full score matrix and the score matmul,
#: mask add and softmax (single-threaded on CPU) shrink with it: this alone took the 135M
#: default model's 512-token prefill from ~1.25 s to ~1.07 s on 2 cores. 64 was slower
#: (per-chunk op overhead), 192 and 256 no faster.
PREFILL_CHUNK: int = 128


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Kernel inputs of one chunk of a multi-token row: its queries are tokens ``[begin, end)``."""

    begin: int                  # first token of the row in the step's flat token array
    end: int                    # one past its last token
    gather_index: paddle.Tensor  # int64 [num_kv_heads * num_blocks]: rows up to its last query
    mask: paddle.Tensor          # [end - begin, num_blocks * block_size] additive causal mask


def write_index(slot_mapping: np.ndarray, block_size: int, num_kv_heads: int) -> np.ndarray:
    """Rows of the ``[-1, head_dim]`` cache view each new token's heads go to.

    ``slot_mapping`` is ``[T]`` (``block * block_size + offset``); the result is
    ``[T * num_kv_heads]`` int64 in token-major, head-minor order, matching new K/V
    reshaped to ``[T * num_kv_heads, head_dim]``.
    """
    block, offset = np.divmod(slot_mapping.astype(np.int64), block_size)
    heads = np.arange(num_kv_heads, dtype=np.int64)
    return ((block[:, None] * num_kv_heads + heads) * block_size + offset[:, None]).reshape(-1)


def gather_index(block_tables: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Rows of the ``[-1, block_size * head_dim]`` cache view holding each row's context.

    ``block_tables`` is ``[R, num_blocks]`` (padded entries may be any valid block id; the
    mask hides them); the result is ``[R * num_kv_heads * num_blocks]`` int64 ordered
    row, head, block.
    """
    heads = np.arange(num_kv_heads, dtype=np.int64)
    return (block_tables.astype(np.int64)[:, None, :] * num_kv_heads + heads[:, None]).reshape(-1)


def decode_mask(context_lens: np.ndarray, padded_len: int, num_heads: int) -> np.ndarray:
    """Additive mask ``[R, num_heads, padded_len]``: row ``r`` sees its first ``context_lens[r]`` keys.

    Materialized per head because Paddle's CPU add is ~20x slower when it has to broadcast
    over middle dimensions than on equal shapes.
    """
    visible = np.arange(padded_len)[None, :] < context_lens[:, None]
    mask = np.where(visible, 0.0, MASKED).astype(np.float32)[:, None, :]
    return np.ascontiguousarray(np.broadcast_to(mask, (len(context_lens), num_heads, padded_len)))


def prefill_mask(start: int, num_new_tokens: int, padded_len: int) -> np.ndarray:
    """Additive causal mask ``[num_new_tokens, padded_len]`` for queries at ``start..``."""
    query_pos = start + np.arange(num_new_tokens)[:, None]
    visible = np.arange(padded_len)[None, :] <= query_pos
    return np.where(visible, 0.0, MASKED).astype(np.float32)


def write_kv_cache(key: paddle.Tensor, value: paddle.Tensor, k_cache: paddle.Tensor,
                   v_cache: paddle.Tensor, index: paddle.Tensor) -> None:
    """Write new ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the caches in place.

    ``index`` comes from :func:`write_index`. ``scatter_`` on a reshape view updates the
    cache's own buffer (same ``data_ptr``, cost independent of the cache size). A cache of
    another dtype (a bfloat16 cache of a float32 model) gets the values cast to it.
    """
    head_dim = k_cache.shape[-1]
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new.reshape([-1, head_dim])
        cache.reshape([-1, head_dim]).scatter_(index, new if new.dtype == cache.dtype else new.astype(cache.dtype),
                                               overwrite=True)


def _scaled(q: paddle.Tensor, scale: float) -> paddle.Tensor:
    """``q * scale``; a scale of 1.0 (already folded into the q projection) costs nothing."""
    return q if scale == 1.0 else q * scale


def _read(cache: paddle.Tensor, index: paddle.Tensor, rows: int, dtype: paddle.dtype) -> paddle.Tensor:
    """Gather ``[rows, num_kv_heads, context, head_dim]`` from a cache via a gather index, as ``dtype``
    (the queries' dtype: a bfloat16 cache of a float32 model is widened after the gather, an int8
    one before it)."""
    if cache.dtype == paddle.int8:   # codes and row scales (int8_cache.py): widened whole first
        cache = int8_cache.widen(cache)
    _, num_kv_heads, block_size, head_dim = cache.shape
    picked = paddle.gather(cache.reshape([-1, block_size * head_dim]), index)
    picked = picked.reshape([rows, num_kv_heads, -1, head_dim])
    return picked if picked.dtype == dtype else picked.astype(dtype)


def decode_attention(q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor,
                     index: paddle.Tensor, mask: paddle.Tensor, scale: float) -> paddle.Tensor:
    """Attention of ``B`` single-query rows, batched: ``q [B, H, D]`` -> ``[B, H, D]``.

    ``index`` is :func:`gather_index` of the rows' padded block tables and ``mask`` their
    :func:`decode_mask`.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # 3-D batched matmuls over (row, kv head) pairs: faster than 4-D on Paddle's CPU build.
    k = _read(k_cache, index, rows, q.dtype).reshape([rows * num_kv_heads, -1, head_dim])
    v = _read(v_cache, index, rows, q.dtype).reshape([rows * num_kv_heads, -1, head_dim])
    q = _scaled(q, scale).reshape([rows * num_kv_heads, group, head_dim])
    scores = paddle.matmul(q, k, transpose_y=True) + mask.reshape([rows * num_kv_heads, group, -1])
    probs = paddle.nn.functional.softmax(scores, axis=-1)
    return paddle.matmul(probs, v).reshape([rows, num_heads, head_dim])


def prefill_attention(q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor,
                      index: paddle.Tensor, mask: paddle.Tensor, scale: float) -> paddle.Tensor:
    """Causal attention of one chunk's ``n`` queries: ``q [n, H, D]`` -> ``[n, H, D]``.

    ``index`` is :func:`gather_index` of the row's blocks up to the chunk's last query and
    ``mask`` its :func:`prefill_mask`; its new K/V must already be in the cache.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = _read(k_cache, index, 1, q.dtype)[0]            # [Hkv, L, D]
    v = _read(v_cache, index, 1, q.dtype)[0]
    # q is usually a strided view of the qkv projection; Paddle's copy of a transposed
    # strided view is ~20x slower than of a transposed contiguous tensor (0.8 vs 0.04 ms
    # for 128 queries), so one plain copy first.
    q = _scaled(q, scale).contiguous().reshape([n, num_kv_heads, group, head_dim])
    q = q.transpose([1, 2, 0, 3])
    scores = paddle.matmul(q.reshape([num_kv_heads, group * n, head_dim]), k, transpose_y=True)
    scores = scores.reshape([num_kv_heads, group, n, -1]) + mask
    probs = paddle.nn.functional.softmax(scores, axis=-1).reshape([num_kv_heads, group * n, -1])
    out = paddle.matmul(probs, v).reshape([num_kv_heads, group, n, head_dim])
    return out.transpose([2, 0, 1, 3]).reshape([n, num_heads, head_dim])


def paged_attention(q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, *,
                    num_decode: int, decode_index: paddle.Tensor | None, decode_mask: paddle.Tensor | None,
                    prefill: Sequence[PrefillChunk], scale: float) -> paddle.Tensor:
    """Attention of a varlen batch ``q [T, H, D]`` whose first ``num_decode`` tokens are decode rows.

    The decode rows are batched through :func:`decode_attention` (``decode_index``/``decode_mask``);
    the remaining tokens are the :class:`PrefillChunk` rows, in order. ``scale`` multiplies q
    (usually ``1 / sqrt(D)``; pass 1.0 when the model already scaled q). Returns ``[T, H, D]``.
    """
    parts = []
    if num_decode:
        parts.append(decode_attention(q[:num_decode], k_cache, v_cache, decode_index, decode_mask, scale))
    for chunk in prefill:
        parts.append(prefill_attention(q[chunk.begin:chunk.end], k_cache, v_cache,
                                       chunk.gather_index, chunk.mask, scale))
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)


def attention_reference(q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor,
                        attn: object, round_queries: bool = False, window: int | None = None) -> paddle.Tensor:
    """The reference ``attention`` kernel variant: :func:`paged_attention` on a step's metadata
    (its gather indices and masks; q already scaled). ``round_queries``: q rounded to bfloat16
    first (nearest even), as the C++ kernel multiplies them on AMX tiles with a bfloat16 cache.
    ``window``: a query at position p sees keys p - window + 1 .. p only (sliding-window layers)."""
    if round_queries:
        q = q.astype("bfloat16").astype("float32")
    decode_mask, prefill = attn.decode_mask, attn.prefill
    if window:
        decode_mask, prefill = _windowed_masks(attn, window)
    return paged_attention(q, k_cache, v_cache, num_decode=attn.num_decode, decode_index=attn.decode_index,
                           decode_mask=decode_mask, prefill=prefill, scale=1.0)


def _windowed_masks(attn: object, window: int) -> tuple[paddle.Tensor | None, tuple[PrefillChunk, ...]]:
    """The step's masks with the keys before each query's window masked too."""
    positions = attn.positions
    decode_mask = attn.decode_mask
    if attn.num_decode:
        width = decode_mask.shape[-1]
        early = np.arange(width)[None, :] <= positions[:attn.num_decode, None] - window
        decode_mask = decode_mask + paddle.to_tensor(np.where(early, MASKED, 0.0).astype(np.float32)[:, None, :],
                                                     dtype=decode_mask.dtype)
    chunks = []
    for chunk in attn.prefill:
        early = np.arange(chunk.mask.shape[-1])[None, :] <= positions[chunk.begin:chunk.end, None] - window
        mask = chunk.mask + paddle.to_tensor(np.where(early, MASKED, 0.0).astype(np.float32), dtype=chunk.mask.dtype)
        chunks.append(PrefillChunk(chunk.begin, chunk.end, chunk.gather_index, mask))
    return decode_mask, tuple(chunks)


def rope_write_kv_reference(cos: paddle.Tensor, sin: paddle.Tensor, attn: object,
                            num_heads: int) -> Callable[[paddle.Tensor, paddle.Tensor, paddle.Tensor], paddle.Tensor]:
    """The reference ``rope_write_kv`` kernel variant, for one step.

    ``cos``/``sin`` are ``[max_positions, D]`` tables (sin with its first half negated, see
    ``fd_core.model.llama``). Returns ``layer(qkv, k_cache, v_cache) -> q``: for a layer's
    projection ``qkv [T, H + 2 * Hkv, D]`` it rotates q and k (Hugging Face's non-interleaved
    convention: ``x * cos + roll(x, D/2) * sin``), writes k and v into the caches at the step's
    slots and returns the rotated ``q [T, H, D]``. The step's cos/sin rows are gathered once here.
    """
    step_tables: list[paddle.Tensor] = []   # cos, sin per (token, rope head): gathered at the first layer

    def layer(qkv: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor) -> paddle.Tensor:
        num_tokens, rope_heads, head_dim = qkv.shape[0], num_heads + k_cache.shape[1], qkv.shape[-1]
        if not step_tables:
            # Paddle's CPU multiply is ~20x slower when it broadcasts a [T, 1, D] operand than on
            # equal shapes, so the rows are repeated per head.
            index = paddle.repeat_interleave(attn.positions_tensor, rope_heads)
            step_tables.extend(paddle.index_select(t, index).reshape([num_tokens, rope_heads, -1]) for t in (cos, sin))
        step_cos, step_sin = step_tables
        qk = qkv[:, :rope_heads]
        qk = qk * step_cos + paddle.roll(qk, head_dim // 2, axis=-1) * step_sin
        write_kv_cache(qk[:, num_heads:], qkv[:, rope_heads:], k_cache, v_cache, attn.write_index)
        return qk[:, :num_heads]

    return layer
