"""Trajectory -> ScoredTrajectory with a ``dora.rewards`` verifier.

An episode's environment reward passes through (``Trajectory.episode.reward``); verifiers
read only the model's turns (``Trajectory.text`` of an episode). A failed trajectory is
scored 0 with its error. A verifier that raises does not lose the trajectory: it is scored
0 with the error recorded (``ScoredTrajectory.error``), as the learner must still see every
trajectory.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dora.events import ScoredTrajectory, Trajectory
from dora.rewards import Verifier, make_verifier
from dora.stage import Context, Stage, derived_id


class VerifierStageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verifier: str = Field(default="exact_match", description="A dora.rewards name.")
    verifier_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _builds(self) -> VerifierStageConfig:
        make_verifier(self.verifier, **self.verifier_config)
        return self


class VerifierStage(Stage):
    """Trajectory -> ScoredTrajectory with a ``dora.rewards`` verifier."""

    name = "verifier"
    consumes = "trajectories"
    emits = {ScoredTrajectory: "scored"}
    concurrency = 8
    Config = VerifierStageConfig

    async def setup(self, ctx: Context) -> None:
        self.verifier: Verifier = make_verifier(self.config.verifier, **self.config.verifier_config)

    async def handle(self, traj: Trajectory, ctx: Context) -> ScoredTrajectory:
        event_id = derived_id(traj.event_id, "scored")
        if traj.error:  # a failed episode: kept, scored 0, and the learner leaves it out
            return self._zero(event_id, traj, f"trajectory failed: {traj.error}")
        episode = traj.episode
        if episode is not None and episode.reward is not None:  # the environment's reward
            return ScoredTrajectory(
                event_id=event_id,
                trajectory=traj,
                reward=episode.reward,
                correct=episode.reward > 0,
                verifier=f"environment:{episode.environment}",
            )
        try:
            result = self.verifier.verify(traj.text, traj.request.prompt)
        except Exception as exc:
            ctx.log.warning("verifier failed", error=repr(exc))
            return self._zero(event_id, traj, f"{type(exc).__name__}: {exc}")
        return ScoredTrajectory(
            event_id=event_id,
            trajectory=traj,
            reward=result.reward,
            correct=result.correct,
            verifier=self.verifier.name,
            details=result.details,
        )

    def _zero(self, event_id: str, traj: Trajectory, error: str) -> ScoredTrajectory:
        """Scored 0 with the reason: never dropped, the learner still sees it."""
        return ScoredTrajectory(
            event_id=event_id, trajectory=traj, reward=0.0, verifier=self.verifier.name, error=error
        )
