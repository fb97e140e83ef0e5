"""How big a synthetic problem is: a truncated zipf law, plus a long stratum every n-th index.

Reasoning RL's response lengths are long-tailed: most answers short, a few very long. Every
synthetic task draws its size (terms, lines, steps) the same way, so the tail is one
mechanism: ``P(n) ~ (n - low + 1) ** -alpha`` on ``[low, high]``, and with ``long_every`` every
``long_every``-th index (``index % long_every == 0``) draws uniformly from
``[long_low, long_high]`` instead, so any ``long_every`` consecutive prompts (a step's worth of
groups) hold one long problem.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LongTail:
    """A size law; ``draw`` consumes the same random numbers for the same arguments."""

    low: int
    high: int
    alpha: float
    long_every: int = 0
    long_low: int = 0
    long_high: int = 0
    _counts: list[int] = field(init=False, repr=False, compare=False)
    _cum: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = list(range(self.low, self.high + 1))
        weights = [(n - self.low + 1) ** -self.alpha for n in counts]
        object.__setattr__(self, "_counts", counts)
        object.__setattr__(self, "_cum", list(itertools.accumulate(weights)))

    def draw(self, rng: random.Random, index: int) -> int:
        """The size of problem ``index``."""
        if self.long_every and index % self.long_every == 0:
            return rng.randint(self.long_low, self.long_high)
        return rng.choices(self._counts, cum_weights=self._cum)[0]
