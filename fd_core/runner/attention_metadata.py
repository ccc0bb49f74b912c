"""Per-step attention inputs: built once on the host from the scheduled rows, read by every layer.

Token order in a step: rows with one new token (decode rows, batched by the kernel) come
first, then multi-token rows (prefill chunks), each row's tokens contiguous. The runner
sorts rows that way (:func:`order_rows`) and lays out ``input_ids`` in the same order.
All index arithmetic is numpy; each device tensor is a single ``paddle.to_tensor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import paddle

from fd_kernels import paged_attention as pa

if TYPE_CHECKING:
    from fd_core.outputs import ScheduledRequest


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What the paged-attention kernel and the model need to run one step.

    Host arrays describe the batch; the ``paddle.Tensor`` fields are exactly what the
    reference kernel (:mod:`fd_kernels.paged_attention`) reads.
    """

    num_tokens: int                      # T = sum(num_new_tokens)
    num_decode: int                      # rows (= tokens) with one new token; they come first
    block_size: int                      # tokens per KV block
    starts: np.ndarray                   # int64 [R]: position of each row's first new token
    num_new_tokens: np.ndarray           # int64 [R]: tokens each row computes this step
    context_lens: np.ndarray             # int64 [R]: starts + num_new_tokens
    block_tables: np.ndarray             # int64 [R, max blocks used]: padded with block 0
    positions: np.ndarray                # int64 [T]: position of every new token
    slot_mapping: np.ndarray             # int64 [T]: block * block_size + offset of each token
    sample_indices: paddle.Tensor        # int64 [S + E]: tokens whose logits the model returns: the last
                                         # token of each sampling row, then the ``extra_logits`` positions
    positions_tensor: paddle.Tensor      # int64 [T]: positions, for the RoPE kernels
    slots_tensor: paddle.Tensor          # int64 [T]: slot_mapping, for the C++ KV write
    row_tables: paddle.Tensor            # int64 [R, W]: block_tables, read in place by the C++ attention
    row_starts: paddle.Tensor            # int64 [R]: starts
    row_lens: paddle.Tensor              # int64 [R]: num_new_tokens
    # Inputs of the reference kernels only (None / empty when ``gather_inputs`` was off):
    write_index: paddle.Tensor | None    # int64 [T * num_kv_heads]: see pa.write_index
    decode_index: paddle.Tensor | None   # int64: pa.gather_index of the decode rows
    decode_mask: paddle.Tensor | None    # [num_decode, num_heads, L] additive mask
    prefill: tuple[pa.PrefillChunk, ...]  # multi-token rows cut at pa.PREFILL_CHUNK, in token order

    def __repr__(self) -> str:
        return (f"AttentionMetadata(tokens={self.num_tokens}, rows={len(self.starts)}, "
                f"decode={self.num_decode}, prefill rows={len(self.starts) - self.num_decode})")


def order_rows(rows: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
    """The rows in step order: single-token rows first, otherwise as given."""
    return sorted(rows, key=lambda row: row.num_new_tokens != 1)


def _prefill_chunks(table: np.ndarray, begin: int, start: int, num_new: int, *, block_size: int,
                    num_kv_heads: int, dtype: str) -> list[pa.PrefillChunk]:
    """Kernel inputs of one multi-token row, cut into chunks of at most ``pa.PREFILL_CHUNK`` queries.

    ``table`` is the row's padded block table, ``begin`` its first token in the step and
    ``start`` that token's position. Each chunk reads only the blocks up to its last query.
    """
    chunks = []
    for offset in range(0, num_new, pa.PREFILL_CHUNK):
        n = min(pa.PREFILL_CHUNK, num_new - offset)
        blocks = -(-(start + offset + n) // block_size)
        chunks.append(pa.PrefillChunk(
            begin=begin + offset, end=begin + offset + n,
            gather_index=paddle.to_tensor(pa.gather_index(table[None, :blocks], num_kv_heads)),
            mask=paddle.to_tensor(pa.prefill_mask(start + offset, n, blocks * block_size),
                                  dtype=dtype),
        ))
    return chunks


def build_attention_metadata(rows: Sequence[ScheduledRequest], *, block_size: int,
                             num_blocks: int, num_heads: int, num_kv_heads: int,
                             dtype: str = "float32", gather_inputs: bool = True,
                             extra_logits: Mapping[int, range] | None = None) -> AttentionMetadata:
    """Build the metadata for ``rows``, already in :func:`order_rows` order.

    ``extra_logits`` maps a row's index to positions of its new tokens whose logits the model
    returns too (prompt logprobs), after the sampling rows' and in row order.

    Block tables, starts, lengths, positions and slots always become tensors (the C++ kernels
    read them); with ``gather_inputs``, so do the gather indices, masks, prefill chunks and
    write index the reference kernels read.

    Raises ``ValueError`` when a row has no new tokens, or its block table is too short for
    its context or names a block outside ``[0, num_blocks)`` (reading it would touch memory
    outside the cache).
    """
    starts = np.fromiter((row.start for row in rows), np.int64, len(rows))
    new = np.fromiter((row.num_new_tokens for row in rows), np.int64, len(rows))
    if new.min() < 1:
        raise ValueError(f"every scheduled row needs num_new_tokens >= 1, got {new.tolist()}")
    assert np.all(np.diff((new != 1).astype(np.int8)) >= 0), "rows not in order_rows order"
    context = starts + new
    needed = -(-context // block_size)
    tables = np.zeros((len(rows), int(needed.max())), np.int64)
    for i, row in enumerate(rows):
        if len(row.block_table) < needed[i]:
            raise ValueError(f"request {row.request.request_id!r}: {len(row.block_table)} KV "
                             f"blocks cannot hold {context[i]} tokens at block_size={block_size}")
        tables[i, :needed[i]] = row.block_table[:needed[i]]
    if tables.min() < 0 or tables.max() >= num_blocks:
        raise ValueError(f"block table entry outside [0, {num_blocks}): "
                         f"min {tables.min()}, max {tables.max()}")

    ends = np.cumsum(new)
    begins = ends - new
    row_of_token = np.repeat(np.arange(len(rows)), new)
    positions = np.arange(int(ends[-1]), dtype=np.int64) - begins[row_of_token] + starts[row_of_token]
    slot_mapping = (tables[row_of_token, positions // block_size] * block_size
                    + positions % block_size)
    samples = [np.array([ends[i] - 1 for i, row in enumerate(rows) if row.sample], np.int64)]
    for i, extra in sorted((extra_logits or {}).items()):
        assert starts[i] <= extra.start and extra.stop <= context[i], "extra logits outside the row"
        samples.append(np.arange(extra.start, extra.stop, dtype=np.int64) - starts[i] + begins[i])

    num_decode = int(np.count_nonzero(new == 1))
    decode_index = decode_mask = write_index = None
    prefill: tuple[pa.PrefillChunk, ...] = ()
    if gather_inputs:
        write_index = paddle.to_tensor(pa.write_index(slot_mapping, block_size, num_kv_heads))
        if num_decode:
            width = int(needed[:num_decode].max())
            decode_index = paddle.to_tensor(pa.gather_index(tables[:num_decode, :width], num_kv_heads))
            decode_mask = paddle.to_tensor(pa.decode_mask(context[:num_decode], width * block_size, num_heads),
                                           dtype=dtype)
        prefill = tuple(chunk for i in range(num_decode, len(rows))
                        for chunk in _prefill_chunks(tables[i], int(begins[i]), int(starts[i]),
                                                     int(new[i]), block_size=block_size,
                                                     num_kv_heads=num_kv_heads, dtype=dtype))
    return AttentionMetadata(
        num_tokens=int(ends[-1]), num_decode=num_decode, block_size=block_size,
        starts=starts, num_new_tokens=new, context_lens=context, block_tables=tables,
        positions=positions, slot_mapping=slot_mapping,
        sample_indices=paddle.to_tensor(np.concatenate(samples)),
        positions_tensor=paddle.to_tensor(positions), slots_tensor=paddle.to_tensor(slot_mapping),
        row_tables=paddle.to_tensor(tables), row_starts=paddle.to_tensor(starts), row_lens=paddle.to_tensor(new),
        write_index=write_index, decode_index=decode_index, decode_mask=decode_mask, prefill=prefill,
    )
