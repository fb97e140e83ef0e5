"""One request inside the engine: its tokens, KV block table and bookkeeping.

``token_ids`` is prompt + completion (resumed tokens included); ``num_computed`` tokens have
KV in the blocks of ``block_table``. The tokens in between are what the next steps compute:
the whole context before the first sample (prefill), then exactly the last sampled token
(decode).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from dora.events import Migration, RolloutRequest, Turn

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    EXPORTED = "exported"
    PARKED = "parked"
    """At a turn boundary: KV resident, not scheduled, waiting for the environment's reply."""
    FINISHED = "finished"


@dataclass
class Sequence:
    """Mutable engine-side state of one request."""

    request: RolloutRequest
    token_ids: list[int]
    num_prompt: int
    version: int
    priority: int = 0
    status: SeqStatus = SeqStatus.WAITING
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    track_versions: bool = False
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # tokens in [0, recompute_hw) had KV computed before (resume or preemption): computing
    # them again is re-prefill, counted honestly in ``reprefilled``
    recompute_hw: int = 0
    reprefilled: int = 0
    appended: list[tuple[int, int, str]] = field(default_factory=list)
    """(start, end, role) of completion spans the environment appended: not sampled, so
    masked out of the loss (multi-turn episodes)."""
    turn_start: int = 0
    """Completion index where the current assistant turn began."""
    parked_before_export: bool = False
    """Exported at a turn boundary: a restore parks it again."""
    parked_at: float = 0.0
    """Wall time it parked at the current turn boundary (0: not parked); kept across a
    migration, so the target knows how long the environment has been working."""
    engines: list[str] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    started_at: float = 0.0
    first_token_at: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    added_at: float = field(default_factory=time.time)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def completion(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_completion(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_pending(self) -> int:
        """Tokens without KV yet (computed by the next step that schedules this sequence)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        """Only the last sampled token is pending: a decode step, not a prefill."""
        return self.num_pending == 1 and self.num_completion > 0

    def loss_mask(self) -> tuple[int, ...]:
        """1 on every completion token the engine sampled, 0 on appended ones."""
        mask = [1] * self.num_completion
        for start, end, _ in self.appended:
            mask[start:end] = [0] * (end - start)
        return tuple(mask)

    def turns(self) -> tuple[Turn, ...]:
        """The completion as assistant and environment spans (empty for a single turn)."""
        if not self.appended:
            return ()
        spans, at = [], 0
        for start, end, role in self.appended:
            if start > at:
                spans.append(Turn(role="assistant", start=at, end=start))
            spans.append(Turn(role=role, start=start, end=end))  # type: ignore[arg-type]
            at = end
        if self.num_completion > at:
            spans.append(Turn(role="assistant", start=at, end=self.num_completion))
        return tuple(spans)

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then first come first served."""
        return (-self.priority, self.arrival)
