"""The bus-facing learner: consume ``scored``, step every B complete groups, publish weights.

Loop: fetch scored trajectories from a durable pull consumer, assemble groups, read the
dispatcher's ledger from the KV store, and whenever ``BatchSelector`` releases a batch run one
optimiser step (off the event loop), publish the new version (``WeightVersion``) and the
step's ``Metrics``, and checkpoint every ``checkpoint_every`` steps. Messages are acked only
once a checkpoint covers them (see ``dora.learner.checkpoint`` for why); a heartbeat task
keeps the held ones from being redelivered meanwhile. Unparseable, malformed and too-stale
samples go to the dead-letter subject with the reason.

This module holds the loop; its parts live beside it: ``service_base`` (shared state),
``service_intake`` (messages into groups, dead letters, ledger), ``service_step`` (one
training step) and ``service_checkpoints`` (save, ack, resume).

Usage::

    service = LearnerService(bus, model, LearnerConfig(batch_groups=8), run_dir, tokenizer=tok)
    await service.run(stop_event)      # resumes from run_dir/checkpoints when one exists
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from dora.bus.base import ConsumerSpec
from dora.learner.metrics import MetricsWriter
from dora.learner.service_base import HISTORY_STEPS, StepHook
from dora.learner.service_intake import LEDGER_KEY, ScoredIntake
from dora.learner.service_step import TrainingStep
from dora.stage.pull import Puller

log = structlog.get_logger(__name__)

MAX_DELIVER = 1_000
"""Held messages are redelivered after every learner crash; never let the server give up."""

__all__ = ["HISTORY_STEPS", "LEDGER_KEY", "MAX_DELIVER", "LearnerService", "StepHook"]


class LearnerService(ScoredIntake, TrainingStep):
    """GRPO learner stage on a bus (see module docstring)."""

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Serve until stopped, ``max_steps`` is reached or the task is cancelled (a crash:
        nothing is acked or checkpointed on cancellation)."""
        cfg = self.config
        resumed = self.restore()
        resumed = await self.fast_forward() or resumed
        self._writer = MetricsWriter(
            self.run_dir, tensorboard=cfg.tensorboard, resume_step=self.step if resumed else None
        )
        await self.report_adopted_step()
        if not resumed and cfg.publish_initial:
            await self.publisher.publish(self.model, 0, step=0)
        consumer = await self.bus.consumer(
            ConsumerSpec(
                durable=cfg.durable,
                filter_subject=self.bus.subjects.scored,
                max_ack_pending=cfg.ack_pending_limit,
                max_deliver=MAX_DELIVER,
                ack_wait_s=cfg.ack_wait_s,
            )
        )
        scored = Puller(consumer, "learner")
        self.ready.set()
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("learner_started", step=self.step, resumed=resumed, b=cfg.batch_groups)
        try:
            while not self._done(stop_event):
                for msg in await scored.fetch(cfg.fetch_batch, cfg.fetch_timeout_s):
                    await self._receive(msg)
                ledger = await self._read_ledger()
                while not self._done(stop_event):
                    self.buffer.expire_stale(self.step)
                    await self._dead_letter_refused()
                    batch = self.selector.select(self.step, ledger)
                    if batch is None:
                        break
                    await self._train(batch)
                if len(self._held) >= 0.8 * cfg.ack_pending_limit:
                    log.info("checkpoint_to_free_ack_room", held=len(self._held))
                    await self._checkpoint()
            if self._held or self._last_checkpoint_step != self.step:
                await self._checkpoint()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            await consumer.close()
            self._writer.close()
        log.info("learner_stopped", step=self.step)

    def _done(self, stop_event: asyncio.Event | None) -> bool:
        if self._stop.is_set() or (stop_event is not None and stop_event.is_set()):
            return True
        return self.config.max_steps is not None and self.step >= self.config.max_steps
