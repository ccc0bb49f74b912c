"""The pool of preallocated KV blocks: reference counts and the LRU free queue.

Structures and their invariants:

* ``KVBlock`` — one block of the device KV cache, created once at start-up and reused forever.
  ``ref_cnt`` is the number of requests whose block table holds it (never negative).
  ``block_hash`` is set while the block is registered in the prefix cache.
* ``FreeBlockQueue`` — every block with ``ref_cnt == 0``, and only those. Hand-rolled as an
  intrusive doubly linked list (links live in the blocks) because a prefix-cache hit must take
  a block out of the *middle* of the queue in O(1). Order: the head is taken first. Plain free
  blocks (no hash) are put at the head, since nothing is lost by reusing them; freed cached
  blocks go to the tail, so the cached ones form an LRU sequence (least recently freed first)
  and are evicted lazily, only when an allocation reaches them.
* ``BlockPool`` — owns both. ``num_free`` counts free plus evictable cached blocks; blocks
  held by requests are ``num_blocks - num_free``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV block; ``prev``/``next`` link it into the free queue (both ``None`` outside it)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None      # set while registered in the prefix cache
    prev: KVBlock | None = None
    next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, appendleft, popleft and remove.

    Two sentinel nodes bound the list, so a block is in the queue exactly when its ``prev``
    is not ``None``.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from head (taken first) to tail (most recently freed cached block)."""
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail: taken after every other free block."""
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the head: taken next."""
        self._link(block, self._head, self._head.next)

    def popleft(self) -> KVBlock:
        block = self._head.next
        assert block is not self._tail and block is not None, "pop from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block!r} is not in the free queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def _link(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        assert block.prev is None and block.next is None, f"{block!r} is already in the free queue"
        assert prev is not None and nxt is not None
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self._len += 1


class BlockPool:
    """Hands out and takes back KV blocks by reference count.

    ``on_evict(block)`` is called when a free block that still carries a cache hash is taken
    for reuse, before its hash is cleared, so that the prefix cache can forget it.
    """

    __slots__ = ("_free", "_on_evict", "blocks")

    def __init__(self, num_blocks: int, *, on_evict: Callable[[KVBlock], None] | None = None) -> None:
        assert num_blocks > 0
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation could take now: plain free plus evictable cached ones."""
        return len(self._free)

    @property
    def free_queue(self) -> FreeBlockQueue:
        """The free queue, read-only by convention (tests and stats inspect its order)."""
        return self._free

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting cached ones on the way."""
        assert 0 <= n <= len(self._free), f"asked for {n} blocks, {len(self._free)} free"
        taken = []
        for _ in range(n):
            block = self._free.popleft()
            assert block.ref_cnt == 0, f"{block!r} was in the free queue while referenced"
            if block.block_hash is not None:
                if self._on_evict is not None:
                    self._on_evict(block)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit), unlinking free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; unreferenced ones become free.

        Callers pass a block table tail first, so that the chain's tail blocks sit nearer the
        head of the LRU order and are evicted before the prefix they extend.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block!r}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free.appendleft(block)
                else:
                    self._free.append(block)
