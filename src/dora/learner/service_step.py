"""One learner step: train on a released batch, publish the new weights and the metrics.

The optimiser step runs off the event loop (the bus stays responsive); the new version is
published as soon as it exists, so engines can load it while the next batch is assembled.
The step's metrics carry the staleness and buffer bookkeeping, so a run's report can show
that nothing was dropped or trained too stale.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from dora.crashpoints import crash_point
from dora.events import Metrics
from dora.learner.batching import Batch
from dora.learner.service_checkpoints import CheckpointGlue

log = structlog.get_logger("dora.learner.service")


class TrainingStep(CheckpointGlue):
    """The step of ``LearnerService`` (see module docstring)."""

    async def _train(self, batch: Batch) -> None:
        step = self.step
        metrics = await asyncio.to_thread(self.trainer.step, batch.groups, step=step)
        crash_point("learner.after_optimizer_step")
        step_end = time.time()
        self.buffer.mark_consumed(batch.groups)
        self.step = step + 1
        self.history.append((step, batch.request_ids))
        # before the version exists: a resume must know what it was trained on
        await asyncio.to_thread(
            self._journal, step, {g.group_id: g.ledger_version for g in batch.groups}
        )
        metrics.update(self._bookkeeping(batch))
        crash_point("learner.before_publish")
        event = await self.publisher.publish(
            self.model, self.step, step=step, metrics=metrics, step_end=step_end
        )
        crash_point("learner.after_publish")
        metrics["weights/publish_s"] = event.metrics["weights/publish_s"]
        metrics["weights/version"] = float(self.step)
        assert self._writer is not None
        self._writer.write(step, metrics)
        record = Metrics(
            step=step,
            values=metrics,
            consumed_groups=tuple(g.group_id for g in batch.groups),
        )
        await self.bus.publish_event(self.bus.subjects.metrics, record)
        log.info(
            "learner_step",
            step=step,
            groups=len(batch.groups),
            reward=round(metrics.get("reward/mean", 0.0), 4),
            loss=round(metrics.get("loss/pg", 0.0), 5),
            wait_s=round(batch.wait_s, 3),
        )
        if self.on_step is not None:
            self.on_step(step, batch, metrics)
        if self.step % self.config.checkpoint_every == 0:
            await self._checkpoint()

    def _bookkeeping(self, batch: Batch) -> dict[str, float]:
        buf = self.buffer
        values = {
            "staleness/wait_s": batch.wait_s,
            "staleness/urgent_groups": float(batch.urgent),
            "staleness/refused_total": float(len(buf.refused)),
            "staleness/oversize_batches": float(self.selector.oversize_batches),
            "staleness/wait_timeouts": float(self.selector.wait_timeouts),
            "groups/duplicates_total": float(buf.duplicates),
            "groups/consumed_total": float(len(buf.consumed)),
            "groups/mixed_version_total": float(len(buf.mixed_version_groups)),
            "buffer/ready_groups": float(len(buf.ready)),
            "buffer/partial_groups": float(len(buf.partial)),
            "buffer/held_messages": float(len(self._held)),
        }
        for version in {g.ledger_version for g in batch.groups}:
            values[f"consumed/v{version}"] = float(buf.consumed_by_version[version])
        return values
