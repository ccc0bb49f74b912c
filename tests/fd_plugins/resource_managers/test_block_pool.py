"""Tests for the v1 block pool: free-queue order, reference counts and double-free guards."""

from __future__ import annotations

import pytest

from fd_plugins.resource_managers.block_pool import BlockPool, FreeBlockQueue, KVBlock


def _ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_allocate_takes_from_the_head_in_id_order():
    pool = BlockPool(5)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert pool.num_free == 3 and _ids(pool) == [2, 3, 4]


def test_plain_blocks_return_to_the_head_cached_ones_to_the_tail_in_lru_order():
    evicted: list[int] = []
    pool = BlockPool(4, on_evict=lambda b: evicted.append(b.block_id))
    a, b, c, d = pool.allocate(4)
    a.block_hash, b.block_hash = b"a", b"b"
    pool.free([a])       # cached: tail
    pool.free([c])       # plain: head
    pool.free([b])       # cached: tail, after a
    assert _ids(pool) == [2, 0, 1]
    # reuse takes the plain block first, then evicts cached ones least recently freed first
    assert [x.block_id for x in pool.allocate(2)] == [2, 0]
    assert evicted == [0] and a.block_hash is None and b.block_hash == b"b"
    pool.free([d])
    assert _ids(pool) == [3, 1]


def test_double_free_and_over_allocation_are_caught():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])
    with pytest.raises(AssertionError):
        pool.allocate(3)


def test_touch_counts_references_and_unlinks_free_blocks():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    block.block_hash = b"h"
    pool.free([block])
    assert block in pool.free_queue and block.ref_cnt == 0
    pool.touch([block])          # a cache hit revives it
    pool.touch([block])          # a second request shares it
    assert block.ref_cnt == 2 and block not in pool.free_queue and pool.num_free == 2
    pool.free([block])
    assert block.ref_cnt == 1 and block not in pool.free_queue
    pool.free([block])
    assert block.ref_cnt == 0 and _ids(pool)[-1] == block.block_id


def test_free_queue_removes_from_the_middle_and_guards_membership():
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3] and len(queue) == 3
    with pytest.raises(AssertionError):
        queue.remove(blocks[2])
    with pytest.raises(AssertionError):
        queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert queue.popleft() is blocks[2]
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 3]
    with pytest.raises(AssertionError):
        queue.popleft()
