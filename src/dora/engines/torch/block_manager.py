"""Fixed-size KV blocks with reference counts and prefix caching by block hash.

A full block is identified by the hash of (parent block hash, its tokens), so two requests
whose prompts share a prefix (a GRPO group shares its whole prompt) map that prefix to the
same physical blocks. Freed blocks keep their hash until they are reused, so a later request
can still hit them (LRU order: the least recently freed block is reused first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from dora.engines.base import CapacityError


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Content hash of a full block chained to its parent (so equal hashes mean equal prefixes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    """Allocates block ids of one KV tensor; never touches the tensor itself."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # free blocks in reuse order; OrderedDict gives O(1) removal on a cache hit
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation

    def _take(self) -> int:
        if not self.free:
            raise CapacityError("no free KV blocks")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1), or CapacityError with nothing taken."""
        if n > len(self.free):
            raise CapacityError(f"need {n} KV blocks, {len(self.free)} free")
        return [self._take() for _ in range(n)]

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their hashes) of the longest full-block prefix of ``tokens``.

        A reference to each returned block is taken.

        Only blocks strictly before the last token are considered, so the block a request
        writes next is always its own.
        """
        if not self.prefix_caching:
            return [], []
        hits: list[int] = []
        hashes: list[bytes] = []
        parent: bytes | None = None
        full = (len(tokens) - 1) // self.block_size
        for i in range(full):
            h = block_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        for block in hits:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
        self.cache_hits += len(hits)
        return hits, hashes

    def register_full_blocks(
        self, table: list[int], tokens: Sequence[int], num_computed: int, hashes: list[bytes]
    ) -> None:
        """Hash the blocks of ``table`` that became full of computed KV (``hashes`` caches them)."""
        if not self.prefix_caching:
            return
        full = min(num_computed // self.block_size, len(table))
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            h = block_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = table[i]
            if self.hash_of[block] is None and h not in self.cached:
                self.hash_of[block] = h
                self.cached[h] = block

    def free_blocks(self, table: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks become reusable."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_count[block] == 0:
                self.free[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (new weights make cached KV invalid)."""
        for h, block in list(self.cached.items()):
            self.hash_of[block] = None
            del self.cached[h]
