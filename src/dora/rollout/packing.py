"""First-fit bin packing in O(log n) per item: a max segment tree over the bins' free blocks.

Consolidation packs an old version's tail requests onto the fullest engines that still have
room. Scanning every target for every request is O(requests x targets), too slow at 10,000
engines; the tree finds the first (fullest-first order) target with enough free blocks and a
free seat in O(log targets).
"""

from __future__ import annotations


class FirstFit:
    """Bins in a fixed order, each with free ``blocks`` and free ``seats`` (request slots)."""

    def __init__(self, blocks: list[int], seats: list[int]) -> None:
        if len(blocks) != len(seats):
            raise ValueError("blocks and seats must have the same length")
        self.blocks = list(blocks)
        self.seats = list(seats)
        self.disabled = [False] * len(blocks)
        size = 1
        while size < max(1, len(blocks)):
            size *= 2
        self.size = size
        tree = [-1] * (2 * size)
        for i, b in enumerate(self.blocks):
            tree[size + i] = b if self.seats[i] > 0 else -1
        for i in range(size - 1, 0, -1):
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
        self.tree = tree

    def _refresh(self, i: int) -> None:
        ok = self.seats[i] > 0 and not self.disabled[i]
        j = self.size + i
        self.tree[j] = self.blocks[i] if ok else -1
        j //= 2
        while j:
            self.tree[j] = max(self.tree[2 * j], self.tree[2 * j + 1])
            j //= 2

    def find(self, need: int) -> int | None:
        """Index of the first enabled bin with a seat and ``>= need`` free blocks."""
        tree = self.tree
        if tree[1] < need:
            return None
        j = 1
        while j < self.size:
            j = 2 * j if tree[2 * j] >= need else 2 * j + 1
        return j - self.size

    def take(self, i: int, need: int) -> None:
        self.blocks[i] -= need
        self.seats[i] -= 1
        self._refresh(i)

    def give(self, i: int, need: int) -> None:
        self.blocks[i] += need
        self.seats[i] += 1
        self._refresh(i)

    def set_enabled(self, i: int, enabled: bool) -> None:
        self.disabled[i] = not enabled
        self._refresh(i)
