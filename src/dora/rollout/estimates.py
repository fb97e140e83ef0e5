"""Remaining-work estimates from the response lengths seen so far.

The orchestrator needs "how many decode tokens are left" for a request that has generated
``g`` tokens. With the empirical distribution of finished lengths ``L`` the best guess is the
conditional expectation ``E[L - g | L > g]`` (a request still running is known to be longer
than ``g``), capped by ``max_tokens - g``. Long-tailed workloads make this much better than the
plain mean: a request that is already long is expected to run long.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Immutable empirical length distribution with O(log n) conditional expectations."""

    lengths: tuple[int, ...] = ()
    """Finished response lengths (completion tokens), sorted ascending."""
    suffix_sums: tuple[int, ...] = (0,)
    """``suffix_sums[i] == sum(lengths[i:])``; one longer than ``lengths``."""
    unknown_fraction: float = 0.5
    """With no finished request longer than ``g``, guess this fraction of ``max_tokens - g``."""

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], unknown_fraction: float = 0.5) -> LengthModel:
        ordered = sorted(int(n) for n in lengths)
        if ordered and ordered[0] < 0:
            raise ValueError(f"lengths: negative length {ordered[0]}")
        if not 0.0 <= unknown_fraction <= 1.0:
            raise ValueError(f"unknown_fraction must be in [0, 1], got {unknown_fraction}")
        suffix = [0] * (len(ordered) + 1)
        for i in range(len(ordered) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + ordered[i]
        return cls(tuple(ordered), tuple(suffix), unknown_fraction)

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def mean(self) -> float:
        return self.suffix_sums[0] / len(self.lengths) if self.lengths else 0.0

    def remaining(self, generated: int, max_tokens: int) -> float:
        """Expected decode tokens left for a running request: ``E[L - g | L > g]``, capped."""
        cap = max_tokens - generated
        if cap <= 0:
            return 0.0
        i = bisect_right(self.lengths, generated)
        longer = len(self.lengths) - i
        if longer == 0:
            return cap * self.unknown_fraction
        return min(self.suffix_sums[i] / longer - generated, float(cap))

    def expected_length(self, max_tokens: int) -> float:
        """Expected total length of a request not started yet (for queued work)."""
        return self.remaining(0, max_tokens) if self.lengths else max_tokens * self.unknown_fraction


@dataclass
class LengthRecorder:
    """Mutable sliding window of finished lengths; ``model()`` snapshots it for ``plan``."""

    window: int = 4096
    _lengths: deque[int] = field(default_factory=deque)
    _model: LengthModel | None = None

    def add(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self._lengths.append(length)
        if len(self._lengths) > self.window:
            self._lengths.popleft()
        self._model = None

    def model(self) -> LengthModel:
        if self._model is None:
            self._model = LengthModel.from_lengths(self._lengths)
        return self._model
