"""A learner stand-in: the real learner's batching and staleness rules, without training.

Rollout tests and throughput benchmarks need something that consumes scored groups exactly as
the GRPO learner does (B complete groups per step, oldest first, waiting for urgent groups,
never past the staleness bound) and publishes a new version after each step, but whose step
costs a configured time instead of a backward pass. It reuses the learner's ``GroupBuffer`` and
``BatchSelector``, so the rules it enforces are the learner's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from dora.bus import Bus, ConsumerSpec
from dora.events import Ledger, Metrics, ScoredTrajectory
from dora.learner.batching import AddOutcome, BatchSelector, GroupBuffer
from dora.subjects import LEDGER_KEY

log = structlog.get_logger(__name__)

PublishVersion = Callable[[int], Awaitable[None]]
"""Publishes weights of a version (a WeightVersion event with a blob)."""


@dataclass
class ConsumedRecord:
    """What one step trained on, for invariant checks."""

    step: int
    at: float
    groups: list[str]
    versions: list[int]
    request_ids: list[str]


@dataclass
class StandinConfig:
    batch_groups: int
    staleness_bound: int
    max_steps: int
    train_time_s: float = 0.0
    """Simulated duration of one optimiser step (wall-clock seconds)."""
    ledger_poll_s: float = 0.05


@dataclass
class LearnerStandin:
    """``await run()``: steps until ``max_steps`` and returns."""

    bus: Bus
    config: StandinConfig
    publish_version: PublishVersion
    step: int = 0
    consumed: list[ConsumedRecord] = field(default_factory=list)
    wait_s: float = 0.0
    durable: str = "learner"
    duplicates: int = 0
    """Samples of a request already received (the learner ignores them; tests assert 0)."""

    async def run(self) -> None:
        buffer = GroupBuffer(self.config.staleness_bound)
        selector = BatchSelector(buffer, self.config.batch_groups)
        consumer = await self.bus.consumer(ConsumerSpec(self.durable, self.bus.subjects.scored))
        try:
            while self.step < self.config.max_steps:
                for msg in await consumer.fetch(batch=256, timeout=self.config.ledger_poll_s):
                    scored = ScoredTrajectory.model_validate_json(msg.data)
                    outcome = buffer.add(scored, step=self.step)
                    if outcome is AddOutcome.REFUSED:
                        raise AssertionError(f"stand-in got a too-stale sample: {scored}")
                    if outcome is AddOutcome.DUPLICATE:
                        self.duplicates += 1
                    await msg.ack()
                raw = await self.bus.kv_get(LEDGER_KEY)
                ledger = Ledger.model_validate_json(raw) if raw else None
                batch = selector.select(self.step, ledger)
                if batch is None:
                    continue
                if self.config.train_time_s:
                    await asyncio.sleep(self.config.train_time_s)  # the simulated step
                buffer.mark_consumed(batch.groups)
                self.wait_s += batch.wait_s
                self.consumed.append(
                    ConsumedRecord(
                        self.step,
                        time.time(),
                        [g.group_id for g in batch.groups],
                        [g.version for g in batch.groups],
                        batch.request_ids,
                    )
                )
                self.step += 1
                await self.publish_version(self.step)
                await self.bus.publish_event(
                    self.bus.subjects.metrics,
                    Metrics(
                        step=self.step - 1,
                        values={"staleness/max": float(max(batch.staleness()))},
                        consumed_groups=tuple(g.group_id for g in batch.groups),
                    ),
                )
                log.info("standin_step", step=self.step - 1, groups=len(batch.groups))
        finally:
            await consumer.close()
