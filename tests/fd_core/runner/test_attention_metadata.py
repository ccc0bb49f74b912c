"""Host-side attention metadata: row order, positions, slots, sample rows and validation."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.outputs import ScheduledRequest
from fd_core.request import Request
from fd_core.runner.attention_metadata import build_attention_metadata, order_rows
from fd_kernels import paged_attention as pa


def _row(rid: str, start: int, n: int, table: list[int], sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(Request(rid, list(range(start + n))), start, n, table, sample)


def test_rows_ordered_decode_first_and_indexed() -> None:
    rows = order_rows([_row("p", 3, 5, [9, 4], sample=False), _row("d", 5, 1, [2, 7]),
                       _row("q", 0, 2, [1])])
    assert [r.request.request_id for r in rows] == ["d", "p", "q"]
    meta = build_attention_metadata(rows, block_size=4, num_blocks=10, num_heads=4, num_kv_heads=2)
    assert meta.num_tokens == 8 and meta.num_decode == 1
    np.testing.assert_array_equal(meta.positions, [5, 3, 4, 5, 6, 7, 0, 1])
    # slot = block_table[pos // 4] * 4 + pos % 4
    np.testing.assert_array_equal(meta.slot_mapping, [29, 39, 16, 17, 18, 19, 4, 5])
    np.testing.assert_array_equal(meta.sample_indices.numpy(), [0, 7])   # "p" does not sample
    np.testing.assert_array_equal(meta.context_lens, [6, 8, 2])
    assert [(c.begin, c.end) for c in meta.prefill] == [(1, 6), (6, 8)]
    assert meta.write_index.shape == [16]


def test_unused_trailing_blocks_are_not_read() -> None:
    meta = build_attention_metadata([_row("d", 2, 1, [3, 8, 5])], block_size=4, num_blocks=10,
                                    num_heads=2, num_kv_heads=1)
    assert meta.block_tables.tolist() == [[3]]
    assert meta.decode_mask.shape == [1, 2, 4]


@pytest.mark.parametrize(("table", "match"), [([1], "cannot hold 6 tokens"), ([1, 10], "outside")])
def test_bad_block_tables_rejected(table: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_attention_metadata([_row("r", 0, 6, table)], block_size=4, num_blocks=10,
                                 num_heads=1, num_kv_heads=1)


def test_long_rows_cut_into_chunks_that_read_only_blocks_up_to_their_last_query() -> None:
    size, start, n = pa.PREFILL_CHUNK, 3, 2 * pa.PREFILL_CHUNK + 5
    table = list(range(1, 2 + (start + n) // 16))
    meta = build_attention_metadata([_row("p", start, n, table)], block_size=16, num_blocks=64,
                                    num_heads=2, num_kv_heads=1)
    assert [(c.begin, c.end) for c in meta.prefill] == [(0, size), (size, 2 * size), (2 * size, n)]
    for chunk in meta.prefill:
        blocks = -(-(start + chunk.end) // 16)
        np.testing.assert_array_equal(chunk.gather_index.numpy(), table[:blocks])
        np.testing.assert_array_equal(chunk.mask.numpy(),
                                      pa.prefill_mask(start + chunk.begin, chunk.end - chunk.begin,
                                                      blocks * 16))
