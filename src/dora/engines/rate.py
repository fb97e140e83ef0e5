"""``TokenRate``: an engine's sampled tokens per second over a sliding window of steps (what
``EngineStatus.tokens_per_s`` reports, and what the orchestrator prices a tail with)."""

from __future__ import annotations

import time
from collections import deque


class TokenRate:
    """Tokens per second over the last ``window`` seconds of steps."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._steps: deque[tuple[float, int]] = deque()

    def add(self, now: float, tokens: int) -> None:
        self._steps.append((now, tokens))

    def per_s(self) -> float:
        """0 until two steps fall in the window."""
        now = time.time()
        while self._steps and self._steps[0][0] < now - self.window:
            self._steps.popleft()
        if len(self._steps) < 2:
            return 0.0
        return sum(n for _, n in self._steps) / max(now - self._steps[0][0], 1e-6)
