"""The bus-facing learner: consume ``scored``, step every B complete groups, publish weights.

Loop: fetch scored trajectories from a durable pull consumer, assemble groups, read the
dispatcher's ledger from the KV store, and whenever ``BatchSelector`` releases a batch run one
optimiser step (off the event loop), publish the new version (``WeightVersion``) and the
step's ``Metrics``, and checkpoint every ``checkpoint_every`` steps. Messages are acked only
once a checkpoint covers them (see ``dora.learner.checkpoint`` for why); a heartbeat task
keeps the held ones from being redelivered meanwhile. Unparseable, malformed and too-stale
samples go to the dead-letter subject with the reason.

Usage::

    service = LearnerService(bus, model, LearnerConfig(batch_groups=8), run_dir, tokenizer=tok)
    await service.run(stop_event)      # resumes from run_dir/checkpoints when one exists
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import structlog
from pydantic import ValidationError

from dora.bus.base import Bus, ConsumerSpec, Message
from dora.events import DeadLetter, Ledger, Metrics, ScoredTrajectory
from dora.learner.batching import AddOutcome, Batch, BatchSelector, GroupBuffer, InvalidTrajectory
from dora.learner.checkpoint import CheckpointManager, LearnerState
from dora.learner.config import LearnerConfig
from dora.learner.metrics import MetricsWriter
from dora.learner.trainer import Trainer
from dora.learner.weights import (
    DirectoryTransport,
    ObjectStoreTransport,
    WeightPublisher,
    WeightTransport,
)
from dora.models import CharTokenizer, LlamaModel

log = structlog.get_logger(__name__)

LEDGER_KEY = "ledger"
HISTORY_STEPS = 1_000
MAX_DELIVER = 1_000
"""Held messages are redelivered after every learner crash; never let the server give up."""

StepHook = Callable[[int, Batch, dict[str, float]], None]


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
        self.bus = bus
        self.model = model
        self.config = config
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.on_step = on_step
        self.trainer = Trainer(model, config.grpo, config.optim, ref_model)
        self.buffer = GroupBuffer(
            config.staleness_bound,
            max_seq_len=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
        )
        self.selector = BatchSelector(self.buffer, config.batch_groups, config.max_urgent_wait_s)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.keep_checkpoints)
        if transport is None:
            if config.weight_store == "directory":
                transport = DirectoryTransport(config.weight_dir or self.run_dir / "weights")
            else:
                transport = ObjectStoreTransport(bus)
        self.publisher = WeightPublisher(bus, transport, config.keep_weight_versions)
        self.step = 0
        self.resumed_from: int | None = None
        self.history: deque[tuple[int, list[str]]] = deque(maxlen=HISTORY_STEPS)
        """(step, request ids) of the last steps this process trained, in order."""
        self._held: list[Message] = []
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the durable consumer exists (publishing to ``scored`` is safe from then)."""
        self._last_checkpoint_step = -1
        self._ledger: Ledger | None = None
        self._ledger_read_at = 0.0
        self._ledger_warned = False
        self._writer: MetricsWriter | None = None

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask ``run`` to finish: it checkpoints (acking what it holds) and returns."""
        self._stop.set()

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

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Serve until stopped, ``max_steps`` is reached or the task is cancelled (a crash:
        nothing is acked or checkpointed on cancellation)."""
        cfg = self.config
        resumed = self.restore()
        self._writer = MetricsWriter(
            self.run_dir, tensorboard=cfg.tensorboard, resume_step=self.step if resumed else None
        )
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
        self.ready.set()
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("learner_started", step=self.step, resumed=resumed, b=cfg.batch_groups)
        try:
            while not self._done(stop_event):
                for msg in await consumer.fetch(cfg.fetch_batch, timeout=cfg.fetch_timeout_s):
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

    # ------------------------------------------------------------------ intake

    async def _receive(self, msg: Message) -> None:
        try:
            scored = ScoredTrajectory.model_validate_json(msg.data)
        except ValidationError as exc:
            await self._dead_letter(msg, f"unparseable ScoredTrajectory: {exc}", term=True)
            return
        try:
            outcome = self.buffer.add(scored, step=self.step)
        except InvalidTrajectory as exc:
            await self._dead_letter(msg, f"invalid trajectory: {exc}", term=True)
            return
        self._held.append(msg)  # acked once a checkpoint covers it (even duplicates)
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

    async def _dead_letter(self, msg: Message, reason: str, *, term: bool) -> None:
        log.error("learner_dead_letter", reason=reason[:300], subject=msg.subject)
        try:
            payload = msg.data.decode("utf-8")
            encoding = "utf-8"
        except UnicodeDecodeError:
            import base64

            payload, encoding = base64.b64encode(msg.data).decode(), "base64"
        event = DeadLetter(
            subject=msg.subject,
            payload=payload,
            payload_encoding=encoding,  # type: ignore[arg-type]
            reason=reason,
            stage="learner",
            deliveries=msg.num_delivered,
        )
        await self.bus.publish_event(self.bus.subjects.deadletter, event)
        if term:
            await msg.term()

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
        self._ledger = ledger
        return ledger

    # ------------------------------------------------------------------ training

    async def _train(self, batch: Batch) -> None:
        step = self.step
        metrics = await asyncio.to_thread(self.trainer.step, batch.groups, step=step)
        step_end = time.time()
        self.buffer.mark_consumed(batch.groups)
        self.step = step + 1
        self.history.append((step, batch.request_ids))
        metrics.update(self._bookkeeping(batch))
        event = await self.publisher.publish(
            self.model, self.step, step=step, metrics=metrics, step_end=step_end
        )
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
        for version in {g.version for g in batch.groups}:
            values[f"consumed/v{version}"] = float(buf.consumed_by_version[version])
        return values

    # ------------------------------------------------------------------ checkpoints

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
