"""Prefix caching: chained hashes of full KV blocks and the map from hash to cached block.

Hash chain: ``hash_0 = H(ROOT_HASH, tokens of block 0)``, ``hash_n = H(hash_{n-1}, tokens of
block n)``, with ``H`` = SHA-256 over the parent digest followed by the tokens as little-endian
int64. Equal hashes therefore mean equal *prefixes*, not just equal blocks, and the digests are
the same in every process and on every run. Only full blocks are ever hashed or cached.

Invariants of :class:`PrefixCache`:

* ``block.block_hash == h`` for every ``h -> block`` entry of the map, and a block carries a
  hash only while the map points at it (one block per hash; a second block computing the
  same prefix is simply left uncached).
* A cached block stays in the map when its last reference goes; it waits in the pool's free
  queue in LRU order and is forgotten only when the pool reuses it (``forget``).
* A lookup never covers a request's last token: a full hit yields at most
  ``num_tokens - 1`` tokens rounded down to whole blocks, so that the last token is
  recomputed and produces logits.
"""

from __future__ import annotations

import sys
from array import array
from hashlib import sha256
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fd_core.request import Request
    from fd_plugins.resource_managers.block_pool import KVBlock

#: Parent of the first block of every request.
ROOT_HASH: Final = sha256(b"fd-engine prefix cache, hash scheme 1").digest()


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of one full block whose predecessor hashed to ``parent``."""
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return sha256(parent + packed.tobytes()).digest()


class PrefixCache:
    """Maps chained block hashes to the cached blocks holding those prefixes."""

    __slots__ = ("_blocks", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[bytes, KVBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def extend_hashes(self, request: Request, hashes: list[bytes], num_full_blocks: int) -> None:
        """Append to ``hashes`` (the request's chain so far) up to ``num_full_blocks`` entries."""
        bs = self.block_size
        assert num_full_blocks * bs <= request.num_tokens
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, request.token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)

    def match(self, request: Request, hashes: list[bytes]) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix of ``request``, last token excluded.

        ``hashes`` is the request's hash chain; it is extended as far as the lookup needs.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.extend_hashes(request, hashes, max_blocks)
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def insert(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a block that just became full; a no-op when it or its prefix is cached."""
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"{block!r} re-registered under another hash"
            return
        if block_hash not in self._blocks:
            block.block_hash = block_hash
            self._blocks[block_hash] = block

    def forget(self, block: KVBlock) -> None:
        """Drop a cached block from the map (the pool is about to reuse it)."""
        assert block.block_hash is not None and self._blocks.get(block.block_hash) is block
        del self._blocks[block.block_hash]
