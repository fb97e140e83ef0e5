"""The learner on the bus: scored samples in, weights and ``Metrics`` out, acks at checkpoints.

A thin shell around ``LearnerCore`` (which decides what to train and when). Loop: fetch scored
samples from the durable ``scored`` consumer, hand each to the core, re-read the dispatcher's
ledger (KV key ``ledger``), and whenever the core releases a batch run one optimiser step off
the event loop, publish the new version (``WeightVersion``) as soon as it exists, write the
step's ``metrics.jsonl`` row, publish its ``Metrics`` (with ``consumed_groups``), and
checkpoint every ``checkpoint_every`` steps.

Messages are acked only once a checkpoint covers them (``dora.learner.checkpoint`` says why);
a heartbeat keeps the held ones from being redelivered meanwhile, so a crash redelivers
exactly what was not saved. What can never be trained on (unparseable, malformed, a version
never published, a second sample for a request, a group refused as too stale) goes to the
dead-letter subject with the reason.

Usage::

    service = LearnerService(bus, model, LearnerConfig(batch_groups=8), run_dir, tokenizer=tok)
    await service.run(stop_event)      # resumes from run_dir/checkpoints when one exists
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from pydantic import ValidationError

from dora.bus.base import Bus, ConsumerSpec, Message
from dora.crashpoints import crash_point
from dora.events import DeadLetter, Ledger, Metrics, ScoredTrajectory, WeightVersion
from dora.learner.batching import Batch
from dora.learner.broadcast import BroadcastServer, BroadcastTransport
from dora.learner.config import LearnerConfig
from dora.learner.core import LearnerCore
from dora.learner.journal import JournalEntry
from dora.learner.metrics import MetricsWriter
from dora.learner.weights import (
    DirectoryTransport,
    ObjectStoreTransport,
    WeightError,
    WeightFetcher,
    WeightPublisher,
    WeightTransport,
)
from dora.models import CharTokenizer, LlamaModel
from dora.stage.deadletter import dead_letter, parse_event
from dora.stage.pull import Puller
from dora.subjects import LEDGER_KEY

log = structlog.get_logger(__name__)

MAX_DELIVER = 1_000
"""Held messages are redelivered after every learner crash; never let the server give up."""

StepHook = Callable[[int, Batch, dict[str, float]], None]

__all__ = ["MAX_DELIVER", "LearnerService", "StepHook"]


class LearnerService:
    """GRPO learner stage on a bus (see module docstring)."""

    def __init__(
        self,
        bus: Bus,
        model: LlamaModel,
        config: LearnerConfig,
        run_dir: Path,
        *,
        tokenizer: CharTokenizer | None = None,
        ref_model: LlamaModel | None = None,
        transport: WeightTransport | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        self.core = core = LearnerCore(
            model, config, run_dir, tokenizer=tokenizer, ref_model=ref_model
        )
        self.model, self.history, self.buffer = core.model, core.history, core.buffer
        self.selector, self.checkpoints = core.selector, core.checkpoints
        self.bus = bus
        self.config = config
        self.run_dir = Path(run_dir)
        self.on_step = on_step
        if transport is None:
            if config.weight_store == "directory":
                transport = DirectoryTransport(config.weight_dir or self.run_dir / "weights")
            elif config.weight_store == "broadcast":
                server = BroadcastServer(config.weight_broadcast)
                transport = BroadcastTransport(server, config.weight_broadcast.timeout_s)
            else:
                transport = ObjectStoreTransport(bus)
        self.publisher = WeightPublisher(bus, transport, config.weight_versions_kept)
        self.ready = asyncio.Event()
        """Set once the durable consumer exists (publishing to ``scored`` is safe from then)."""
        self._held: list[Message] = []
        self._stop = asyncio.Event()
        self._ledger: Ledger | None = None
        self._ledger_read_at = 0.0
        self._ledger_warned = False
        self._adopted: tuple[WeightVersion, JournalEntry] | None = None
        self._writer: MetricsWriter | None = None

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def resumed_from(self) -> int | None:
        return self.core.resumed_from

    def stop(self) -> None:
        """Ask ``run`` to finish: it checkpoints (acking what it holds) and returns."""
        self._stop.set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Serve until stopped, ``max_steps`` is reached or the task is cancelled (a crash:
        nothing is acked or checkpointed on cancellation)."""
        cfg, core = self.config, self.core
        resumed = core.restore()
        resumed = await self._fast_forward() or resumed
        self._writer = MetricsWriter(
            self.run_dir, tensorboard=cfg.tensorboard, resume_step=core.step if resumed else None
        )
        await self._report_adopted_step()
        if not resumed and cfg.publish_initial:
            await self.publisher.publish(core.model, 0, step=0)
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
        log.info("learner_started", step=core.step, resumed=resumed, b=cfg.batch_groups)
        try:
            while not self._done(stop_event):
                for msg in await scored.fetch(cfg.fetch_batch, cfg.fetch_timeout_s):
                    await self._receive(msg)
                ledger = await self._read_ledger()
                while not self._done(stop_event):
                    await self._dead_letter_refused()
                    batch = core.next_batch(ledger)
                    if batch is None:
                        break
                    await self._train(batch)
                if len(self._held) >= 0.8 * cfg.ack_pending_limit:
                    log.info("checkpoint_to_free_ack_room", held=len(self._held))
                    await self._checkpoint()
            if self._held or core.checkpointed_step != core.step:
                await self._checkpoint()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            await consumer.close()
            self._writer.close()
        log.info("learner_stopped", step=core.step)

    def _done(self, stop_event: asyncio.Event | None) -> bool:
        if self._stop.is_set() or (stop_event is not None and stop_event.is_set()):
            return True
        return self.config.max_steps is not None and self.core.step >= self.config.max_steps

    # ------------------------------------------------------------------ intake

    async def _receive(self, msg: Message) -> None:
        scored, reason = parse_event(ScoredTrajectory, msg.data)
        if scored is not None:
            reason = self.core.accept(scored, redelivered=msg.num_delivered > 1) or ""
        if reason:
            log.error("learner_dead_letter", reason=reason[:300], subject=msg.subject)
            await dead_letter(self.bus, msg, "learner", reason)
            return
        self._held.append(msg)  # acked once a checkpoint covers it (even redeliveries)

    async def _dead_letter_refused(self) -> None:
        """Every sample of the groups refused as too stale (never trained on)."""
        for sample, reason in self.core.take_refused():
            event = DeadLetter(
                event_id=f"learner-stale-{sample.event_id}",
                subject=self.bus.subjects.scored,
                payload=sample.model_dump_json(),
                reason=reason,
                stage="learner",
            )
            await self.bus.publish_event(self.bus.subjects.deadletter, event)

    async def _heartbeat(self) -> None:
        """Keep held messages from being redelivered while they wait for a checkpoint."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            for msg in list(self._held):
                try:
                    await msg.in_progress()
                except Exception as exc:  # a lost heartbeat only risks a deduped redelivery
                    log.warning("heartbeat_failed", error=str(exc))
                    break

    async def _read_ledger(self) -> Ledger | None:
        """The dispatcher's ledger, re-read at most every ``ledger_poll_s``: the selector uses
        it to wait for an unfinished urgent group instead of stepping past it."""
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
        dropped = self.core.abandon(ledger.abandoned_groups)
        if dropped:
            log.warning("abandoned_groups_dropped", samples=dropped)
        self._ledger = ledger
        return ledger

    # ------------------------------------------------------------------ one step

    async def _train(self, batch: Batch) -> None:
        core = self.core
        step = core.step
        metrics = await asyncio.to_thread(core.train, batch)
        step_end = time.time()
        metrics["buffer/held_messages"] = float(len(self._held))
        crash_point("learner.before_publish")
        event = await self.publisher.publish(
            core.model, core.step, step=step, metrics=metrics, step_end=step_end
        )
        crash_point("learner.after_publish")
        metrics["weights/publish_s"] = event.metrics["weights/publish_s"]
        metrics["weights/version"] = float(core.step)
        assert self._writer is not None
        self._writer.write(step, metrics)
        groups = tuple(g.group_id for g in batch.groups)
        record = Metrics(step=step, values=metrics, consumed_groups=groups)
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
        if core.step % self.config.checkpoint_every == 0:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Write a checkpoint, then ack every message it covers."""
        held, self._held = self._held, []
        try:
            await asyncio.to_thread(self.core.save_checkpoint)
        except BaseException:
            self._held = held + self._held
            raise
        for msg in held:
            await msg.ack()

    # ------------------------------------------------------------------ resume

    async def _fast_forward(self) -> bool:
        """After ``restore`` (or with no checkpoint yet, from step 0): adopt the newest published
        version if it is past the learner's step; True when it did."""
        fetcher = WeightFetcher(self.bus)
        try:
            latest = await fetcher.describe()
        except WeightError:
            return False
        fetcher.transports[latest.blob.store] = self.publisher.transport  # the one we wrote
        entries = self.core.steps_to_adopt(latest.version)
        if entries is None:
            return False
        checkpoint_step = self.core.step
        try:
            state = await fetcher.fetch(latest)
        except WeightError as exc:
            if latest.blob.store != "broadcast":
                raise
            raise WeightError(
                f"cannot resume past step {checkpoint_step}: version {latest.version} was "
                "broadcast from the memory of the learner that stopped; resume needs a "
                "checkpoint of every published step (checkpoint_every: 1) or a durable "
                "weight_store (objectstore, directory)"
            ) from exc
        self.core.adopt(latest.version, state, entries)
        log.info("learner_fast_forwarded", checkpoint_step=checkpoint_step, version=latest.version)
        self._adopted = (latest, entries[-1]) if entries else None
        return True

    async def _report_adopted_step(self) -> None:
        """The step that produced the adopted version may have died between publishing its
        weights and reporting the step (the ``metrics.jsonl`` row, then the ``Metrics``
        event): report it now, from the weights event's metrics and the journal, or the row
        is missing for good and the dispatcher never learns its groups were consumed."""
        adopted, self._adopted = self._adopted, None
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
