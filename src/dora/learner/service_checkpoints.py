"""Checkpoint and resume glue of the learner service.

A checkpoint holds the model, the optimiser and the buffer's bookkeeping (consumed and
refused groups, samples still buffered), so the messages it covers can be acked: after a
crash the learner resumes from it and the bus redelivers only what came after
(``dora.learner.checkpoint`` says why acks wait for a checkpoint).
"""

from __future__ import annotations

import asyncio

from dora.learner.checkpoint import LearnerState
from dora.learner.service_base import LearnerBase


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
