"""Learner intake: scored trajectories into groups, refusals to dead letters, the ledger.

Every valid message is *held* (not acked) once its sample is in the group buffer: it is acked
only when a checkpoint covers it, so a crash redelivers exactly what was not saved. The
heartbeat keeps held messages from being redelivered meanwhile. Nothing is dropped silently:
an unparseable or malformed message, a sample naming a version never published, a second
sample claiming a request already received, and every sample of a group refused as too stale
go to the dead-letter subject with the reason.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from pydantic import ValidationError

from dora.bus.base import Message
from dora.events import DeadLetter, Ledger, ScoredTrajectory
from dora.learner.batching import AddOutcome, InvalidTrajectory, sample_version
from dora.learner.service_base import LearnerBase
from dora.stage.deadletter import dead_letter, parse_event

log = structlog.get_logger("dora.learner.service")

LEDGER_KEY = "ledger"
"""The KV key under which the dispatcher keeps its staleness ``Ledger``."""


class ScoredIntake(LearnerBase):
    """Consumption side of ``LearnerService`` (see module docstring)."""

    async def _receive(self, msg: Message) -> None:
        scored, reason = parse_event(ScoredTrajectory, msg.data)
        if scored is None:
            await self._dead_letter(msg, reason)
            return
        version = sample_version(scored)
        if version > self.step:  # this learner has published versions 0..step
            await self._dead_letter(
                msg, f"unknown version: sampled by v{version}, newest published v{self.step}"
            )
            return
        try:
            outcome = self.buffer.add(scored, step=self.step)
        except InvalidTrajectory as exc:
            await self._dead_letter(msg, f"invalid trajectory: {exc}")
            return
        if outcome is AddOutcome.DUPLICATE and msg.num_delivered <= 1:
            # A redelivery (num_delivered > 1) is expected after a crash; a first delivery of
            # a sample already received is a second event claiming the same request.
            request = scored.trajectory.request
            await self._dead_letter(
                msg, f"duplicate: a sample of request {request.request_id!r} was already received"
            )
            return
        self._held.append(msg)  # acked once a checkpoint covers it (even redeliveries)
        if outcome is AddOutcome.REFUSED:
            await self._dead_letter_refused()

    async def _dead_letter_refused(self) -> None:
        """Dead-letter every sample of the groups refused as too stale (never trained on)."""
        groups, self.buffer.newly_refused = self.buffer.newly_refused, []
        for group in groups:
            for s in group.samples:
                reason = (
                    f"too stale: version {group.version} at learner step {self.step} "
                    f"exceeds staleness bound {self.config.staleness_bound}"
                )
                event = DeadLetter(
                    event_id=f"learner-stale-{s.event_id}",
                    subject=self.bus.subjects.scored,
                    payload=s.model_dump_json(),
                    reason=reason,
                    stage="learner",
                )
                await self.bus.publish_event(self.bus.subjects.deadletter, event)

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        """Keep a sample the learner will never train on, with the reason; never redeliver it."""
        log.error("learner_dead_letter", reason=reason[:300], subject=msg.subject)
        await dead_letter(self.bus, msg, "learner", reason)

    async def _heartbeat(self) -> None:
        """Keep held messages from being redelivered while they wait for a checkpoint."""
        period = self.config.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for msg in list(self._held):
                try:
                    await msg.in_progress()
                except Exception as exc:  # a lost heartbeat only risks a deduped redelivery
                    log.warning("heartbeat_failed", error=str(exc))
                    break

    async def _read_ledger(self) -> Ledger | None:
        """The dispatcher's ledger, re-read at most every ``ledger_poll_s``: the selector
        uses it to wait for an unfinished urgent group instead of stepping past it."""
        now = time.monotonic()
        if now - self._ledger_read_at < self.config.ledger_poll_s:
            return self._ledger
        self._ledger_read_at = now
        raw = await self.bus.kv_get(LEDGER_KEY)
        if raw is None:
            return self._ledger
        try:
            ledger = Ledger.model_validate_json(raw)
        except ValidationError as exc:
            log.error("ledger_unreadable", error=str(exc)[:300])
            return self._ledger
        if ledger.staleness_bound != self.config.staleness_bound and not self._ledger_warned:
            self._ledger_warned = True
            log.warning(
                "staleness_bound_mismatch",
                ledger=ledger.staleness_bound,
                learner=self.config.staleness_bound,
            )
        dropped = self.buffer.abandon(ledger.abandoned_groups)
        if dropped:
            log.warning("abandoned_groups_dropped", samples=dropped)
        self._ledger = ledger
        return ledger
