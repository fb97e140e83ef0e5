"""The learner's core: groups in, GRPO steps out, checkpoints and resume. No bus.

The shell (``dora.learner.service``) moves messages: it reads scored samples, hands each to
``accept``, publishes the weights and ``Metrics`` of every step, and acks what a checkpoint
covers. This core decides: which samples are trainable, when a batch is released (the
staleness bound K and the dispatcher's ledger, ``dora.learner.batching``), the optimiser step,
what a checkpoint holds, and how a restarted learner continues past versions published after
its checkpoint (the step journal names the groups they consumed, ``dora.learner.journal``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dora.crashpoints import crash_point
from dora.events import Ledger, ScoredTrajectory
from dora.learner.batching import (
    AddOutcome,
    Batch,
    BatchSelector,
    Group,
    GroupBuffer,
    InvalidTrajectory,
    sample_version,
)
from dora.learner.checkpoint import CheckpointManager, LearnerState
from dora.learner.config import LearnerConfig
from dora.learner.journal import JournalEntry, StepJournal
from dora.learner.trainer import Trainer
from dora.models import CharTokenizer, LlamaModel
from dora.models.checkpoint import load_state_dict_into

HISTORY_STEPS = 1_000


class LearnerCore:
    """Model, trainer, group buffer and step counter of one learner (see module docstring)."""

    def __init__(
        self,
        model: LlamaModel,
        config: LearnerConfig,
        run_dir: Path,
        *,
        tokenizer: CharTokenizer | None = None,
        ref_model: LlamaModel | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.trainer = Trainer(model, config.grpo, config.optim, ref_model)
        self.buffer = GroupBuffer(
            config.staleness_bound,
            max_seq_len=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
        )
        self.selector = BatchSelector(self.buffer, config.batch_groups, config.max_urgent_wait_s)
        self.checkpoints = CheckpointManager(Path(run_dir) / "checkpoints", config.keep_checkpoints)
        self.journal = StepJournal(Path(run_dir) / "checkpoints" / "journal.jsonl")
        self.step = 0
        """Steps taken; the newest version this learner published is ``step``."""
        self.resumed_from: int | None = None
        self.checkpointed_step = -1
        self.history: deque[tuple[int, list[str]]] = deque(maxlen=HISTORY_STEPS)
        """(step, request ids) of the last steps this process trained, in order."""

    # ------------------------------------------------------------------ intake

    def accept(self, scored: ScoredTrajectory, redelivered: bool) -> str | None:
        """Buffer ``scored``; the reason it can never be trained on, or None.

        A redelivery of a sample already received is expected after a crash (and kept: its
        message is acked by the next checkpoint); a first delivery of one is a second event
        claiming the same request."""
        version = sample_version(scored)
        if version > self.step:  # this learner has published versions 0..step
            return f"unknown version: sampled by v{version}, newest published v{self.step}"
        try:
            outcome = self.buffer.add(scored, step=self.step)
        except InvalidTrajectory as exc:
            return f"invalid trajectory: {exc}"
        if outcome is AddOutcome.DUPLICATE and not redelivered:
            request = scored.trajectory.request
            return f"duplicate: a sample of request {request.request_id!r} was already received"
        return None

    def take_refused(self) -> list[tuple[ScoredTrajectory, str]]:
        """Samples of the groups refused as too stale since the last call, with the reason."""
        groups: list[Group]
        groups, self.buffer.newly_refused = self.buffer.newly_refused, []
        reasons = []
        for group in groups:
            reason = (
                f"too stale: version {group.version} at learner step {self.step} "
                f"exceeds staleness bound {self.config.staleness_bound}"
            )
            reasons.extend((sample, reason) for sample in group.samples)
        return reasons

    def abandon(self, group_ids: Any) -> int:
        """Drop what is buffered of groups the dispatcher abandoned; samples dropped."""
        return self.buffer.abandon(group_ids)

    # ------------------------------------------------------------------ stepping

    def next_batch(self, ledger: Ledger | None) -> Batch | None:
        """The next batch to train on, or None (wait for more groups)."""
        self.buffer.expire_stale(self.step)
        return self.selector.select(self.step, ledger)

    def train(self, batch: Batch) -> dict[str, float]:
        """One optimiser step on ``batch`` (blocking: run it off the event loop). The step is
        journaled before its version exists: a resume must know what it was trained on."""
        step = self.step
        metrics = self.trainer.step(batch.groups, step=step)
        crash_point("learner.after_optimizer_step")
        self.buffer.mark_consumed(batch.groups)
        self.step = step + 1
        self.history.append((step, batch.request_ids))
        self.journal.append(
            JournalEntry(step, {g.group_id: g.ledger_version for g in batch.groups})
        )
        metrics.update(self._bookkeeping(batch))
        return metrics

    def _bookkeeping(self, batch: Batch) -> dict[str, float]:
        """Staleness and buffer counters: a run's report shows nothing dropped or too stale."""
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
        }
        for version in {g.ledger_version for g in batch.groups}:
            values[f"consumed/v{version}"] = float(buf.consumed_by_version[version])
        return values

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        """Model, optimiser and the buffer's bookkeeping (blocking)."""
        self.checkpoints.save(self.model, self.trainer.state_dict(), self._state(), self.tokenizer)
        self.checkpointed_step = self.step

    def restore(self) -> bool:
        """Load the latest checkpoint if there is one; True when resumed."""
        if self.checkpoints.latest() is None:
            return False
        trainer_state, state = self.checkpoints.load(self.model)
        self.trainer.load_state_dict(trainer_state)
        self._apply_state(state)
        self.resumed_from = state.step
        self.checkpointed_step = state.step
        return True

    def steps_to_adopt(self, version: int) -> list[JournalEntry] | None:
        """The journaled steps between this learner's step and a newer published ``version``;
        raises when one is missing (the run cannot go on without training a published version
        number again)."""
        if version <= self.step:
            return None
        entries = self.journal.entries(self.step, version)
        if entries is None:
            raise RuntimeError(
                f"resume: weights v{version} were published after checkpoint step "
                f"{self.step}, but {self.journal.path} lacks the steps in between"
            )
        return entries

    def adopt(self, version: int, weights: Mapping[str, Any], entries: list[JournalEntry]) -> None:
        """Continue from published ``version``: its weights, and its journaled groups consumed."""
        load_state_dict_into(self.model, weights)
        buf = self.buffer
        for entry in entries:
            for gid, group_version in entry.groups.items():
                buf.ready.pop(gid, None)
                buf.partial.pop(gid, None)
                if gid not in buf.consumed:
                    buf.consumed.add(gid)
                    buf.consumed_by_version[group_version] += 1
        self.step = version

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
