"""Tests for chained block hashes and the prefix cache's longest-prefix lookup."""

from __future__ import annotations

from fd_core.request import Request
from fd_plugins.resource_managers.block_pool import BlockPool
from fd_plugins.resource_managers.v1.prefix_cache import ROOT_HASH, PrefixCache, hash_block

BS = 4


def _hashes(cache: PrefixCache, tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    cache.extend_hashes(Request("r", tokens), hashes, len(tokens) // BS)
    return hashes


def test_hash_is_deterministic_and_chained():
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(b"x" * 32, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [1, 2, 3, 4])
    cache = PrefixCache(BS)
    base = list(range(12))
    same_start = [*base[:8], 99, 99, 99, 99]
    other_first = [42, *base[1:]]
    a, b, c = _hashes(cache, base), _hashes(cache, same_start), _hashes(cache, other_first)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # a different first block changes every later hash, although later tokens are equal
    assert all(x != y for x, y in zip(a, c, strict=True))


def _cache_with(tokens: list[int]) -> tuple[PrefixCache, BlockPool, list]:
    cache = PrefixCache(BS)
    pool = BlockPool(8, on_evict=cache.forget)
    hashes = _hashes(cache, tokens)
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes, strict=True):
        cache.insert(block, h)
    return cache, pool, blocks


def test_match_returns_the_longest_cached_prefix_and_recomputes_the_last_token():
    cache, _, blocks = _cache_with(list(range(12)))
    # exactly the cached 12 tokens: the last token must be recomputed, so 2 whole blocks
    assert cache.match(Request("a", list(range(12))), []) == blocks[:2]
    assert cache.match(Request("b", list(range(13))), []) == blocks
    assert cache.match(Request("c", [*list(range(6)), 0, 0, 0]), []) == blocks[:1]
    assert cache.match(Request("d", [7, *list(range(1, 12))]), []) == []


def test_evicted_blocks_are_forgotten_and_duplicates_stay_uncached():
    cache, pool, blocks = _cache_with(list(range(8)))
    duplicate = pool.allocate(1)[0]
    cache.insert(duplicate, blocks[0].block_hash)
    assert duplicate.block_hash is None and len(cache) == 2
    pool.free(blocks[::-1])
    assert cache.match(Request("a", list(range(9))), []) == blocks   # free but still cached
    pool.allocate(pool.num_free)                                       # reuse evicts both
    assert len(cache) == 0 and cache.match(Request("b", list(range(9))), []) == []
