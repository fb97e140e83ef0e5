"""BlockManager: allocation, refcounts, prefix-cache hits, LRU reuse of freed cached blocks."""

from __future__ import annotations

import pytest

from dora.engines.base import CapacityError
from dora.engines.torch.block_manager import BlockManager, block_hash


def _filled(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    table = bm.allocate(bm.blocks_needed(len(tokens)))
    hashes: list[bytes] = []
    bm.register_full_blocks(table, tokens, len(tokens), hashes)
    return table, hashes


def test_allocate_and_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate(3)
    assert bm.num_used == 3 and bm.num_free == 1
    with pytest.raises(CapacityError, match="need 2"):
        bm.allocate(2)
    assert bm.num_free == 1  # a refused allocation takes nothing
    bm.free_blocks(table)
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free_blocks(table)


def test_prefix_hit_shares_blocks_with_refcount() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table, hashes = _filled(bm, tokens)
    assert len(hashes) == 2
    hits, hit_hashes = bm.match_prefix([*tokens, 99])
    assert hits == table[:2] and hit_hashes == hashes
    assert [bm.ref_count[b] for b in hits] == [2, 2]
    # a different second block only matches the first
    other, _ = bm.match_prefix([0, 1, 2, 3, 7, 7, 7, 7, 1])
    assert other == table[:1]


def test_last_token_block_is_never_shared() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    _filled(bm, tokens)
    hits, _ = bm.match_prefix(tokens)  # exactly 2 full blocks: the 2nd holds the last token
    assert len(hits) == 1


def test_freed_cached_blocks_stay_hittable_until_reused() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    table, _ = _filled(bm, [5, 6, 7, 8])
    bm.free_blocks(table)
    hits, _ = bm.match_prefix([5, 6, 7, 8, 9])
    assert hits == table  # revived from the free list
    bm.free_blocks(hits)
    bm.allocate(3)  # reuses every block: the hashes are forgotten
    bm.free_blocks([0, 1, 2])
    assert bm.match_prefix([5, 6, 7, 8, 9]) == ([], [])


def test_hash_chains_parent() -> None:
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2])
    assert block_hash(None, [1, 2]) == block_hash(None, [1, 2])


def test_reset_and_disabled_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    _filled(bm, [1, 2, 3])
    bm.reset_prefix_cache()
    assert bm.match_prefix([1, 2, 3]) == ([], [])
    off = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    _filled(off, [1, 2, 3])
    assert off.match_prefix([1, 2, 3]) == ([], [])
