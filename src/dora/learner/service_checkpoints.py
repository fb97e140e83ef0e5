"""Checkpoint and resume glue of the learner service.

A checkpoint holds the model, the optimiser and the buffer's bookkeeping (consumed and
refused groups, samples still buffered), so the messages it covers can be acked: after a
crash the learner resumes from it and the bus redelivers only what came after
(``dora.learner.checkpoint`` says why acks wait for a checkpoint). Versions published after
that checkpoint are not trained again: the learner continues from the newest one, with the
step journal naming the groups they consumed (``dora.learner.journal``).
"""

from __future__ import annotations

import asyncio

import structlog

from dora.events import Metrics
from dora.learner.checkpoint import LearnerState
from dora.learner.journal import JournalEntry
from dora.learner.service_base import LearnerBase
from dora.learner.weights import WeightError, WeightFetcher
from dora.models.checkpoint import load_state_dict_into

log = structlog.get_logger("dora.learner.service")


class CheckpointGlue(LearnerBase):
    """Save / restore of ``LearnerService`` (see module docstring)."""

    def restore(self) -> bool:
        """Load the latest checkpoint of ``run_dir`` if there is one; True when resumed."""
        if self.checkpoints.latest() is None:
            return False
        trainer_state, state = self.checkpoints.load(self.model)
        self.trainer.load_state_dict(trainer_state)
        self._apply_state(state)
        self.resumed_from = state.step
        self._last_checkpoint_step = state.step
        return True

    async def fast_forward(self) -> bool:
        """After ``restore`` (or with no checkpoint yet, from step 0): adopt the newest published
        version if it is past the learner's step; True when it did.

        Raises when the journal lacks one of the steps in between: the run cannot continue
        without training a published version number again, so it stops with the reason.
        """
        fetcher = WeightFetcher(self.bus)
        try:
            latest = await fetcher.describe()
        except WeightError:
            return False
        fetcher.transports[latest.blob.store] = self.publisher.transport  # the one we wrote
        if latest.version <= self.step:
            return False
        entries = self.journal.entries(self.step, latest.version)
        if entries is None:
            raise RuntimeError(
                f"resume: weights v{latest.version} were published after checkpoint step "
                f"{self.step}, but {self.journal.path} lacks the steps in between"
            )
        state = await fetcher.fetch(latest)
        load_state_dict_into(self.model, state)
        buf = self.buffer
        for entry in entries:
            for gid, version in entry.groups.items():
                buf.ready.pop(gid, None)
                buf.partial.pop(gid, None)
                if gid not in buf.consumed:
                    buf.consumed.add(gid)
                    buf.consumed_by_version[version] += 1
        log.info("learner_fast_forwarded", checkpoint_step=self.step, version=latest.version)
        self.step = latest.version
        self._adopted = (latest, entries[-1]) if entries else None
        return True

    async def report_adopted_step(self) -> None:
        """The step that produced the adopted version may have died between publishing its
        weights and reporting the step (the ``metrics.jsonl`` row, then the ``Metrics``
        event): report it now, from the weights event's metrics and the journal, or the row
        is missing for good and the dispatcher never learns its groups were consumed."""
        adopted, self._adopted = getattr(self, "_adopted", None), None
        if adopted is None or self._writer is None:
            return
        event, entry = adopted
        if entry.step != event.step or self._writer.has_step(entry.step):
            return  # reported before the crash (the row is written before the event)
        values = {**event.metrics, "weights/version": float(event.version)}
        self._writer.write(entry.step, values)
        record = Metrics(step=entry.step, values=values, consumed_groups=tuple(entry.groups))
        await self.bus.publish_event(self.bus.subjects.metrics, record)
        log.info("learner_step_reported_after_resume", step=entry.step)

    def _journal(self, step: int, groups: dict[str, int]) -> None:
        self.journal.append(JournalEntry(step, groups))

    def _state(self) -> LearnerState:
        buf = self.buffer
        return LearnerState(
            step=self.step,
            consumed_groups=sorted(buf.consumed),
            refused_groups=sorted(buf.refused),
            consumed_by_version=dict(buf.consumed_by_version),
            refused_by_version=dict(buf.refused_by_version),
            buffered=buf.buffered_events(),
            counters={"duplicates": float(buf.duplicates)},
        )

    def _apply_state(self, state: LearnerState) -> None:
        buf = self.buffer
        self.step = state.step
        buf.consumed = set(state.consumed_groups)
        buf.refused = set(state.refused_groups)
        buf.consumed_by_version.update(state.consumed_by_version)
        buf.refused_by_version.update(state.refused_by_version)
        buf.duplicates = int(state.counters.get("duplicates", 0))
        for scored in state.buffered:
            buf.add(scored, step=state.step)

    async def _checkpoint(self) -> None:
        """Write a checkpoint, then ack every message it covers."""
        state = self._state()
        held, self._held = self._held, []
        try:
            await asyncio.to_thread(
                self.checkpoints.save,
                self.model,
                self.trainer.state_dict(),
                state,
                self.tokenizer,
            )
        except BaseException:
            self._held = held + self._held
            raise
        self._last_checkpoint_step = self.step
        for msg in held:
            await msg.ack()
