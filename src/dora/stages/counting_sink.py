"""A sink that counts scored trajectories (each event id once) and completes after ``expect``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dora.events import ScoredTrajectory
from dora.stage import Context, Stage


class CountingSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expect: int | None = Field(
        default=None, ge=0, description="Complete after this many distinct events (None: never)."
    )
    print_every: int = Field(default=0, ge=0, description="Log every k-th event (0: never).")


class CountingSink(Stage):
    """Counts distinct ``ScoredTrajectory`` events, rewards and correct ones.

    Redelivered events (same event id) are counted once, so its totals are exactly-once.
    """

    name = "sink"
    consumes = "scored"
    concurrency = 16
    Config = CountingSinkConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[str] = set()
        self.correct = 0
        self.reward_sum = 0.0
        self.errors = 0
        self.redelivered = 0

    @property
    def finite(self) -> bool:  # type: ignore[override]
        return self.config.expect is not None

    async def handle(self, scored: ScoredTrajectory, ctx: Context) -> None:
        if scored.event_id in self.seen:
            self.redelivered += 1
            return
        self.seen.add(scored.event_id)
        self.correct += int(scored.correct)
        self.reward_sum += scored.reward
        self.errors += int(bool(scored.error))
        count = len(self.seen)
        if self.config.print_every and count % self.config.print_every == 0:
            prompt = scored.trajectory.request.prompt
            ctx.log.info(
                "scored",
                count=count,
                prompt_id=prompt.prompt_id,
                reward=scored.reward,
                answer=prompt.answer,
            )
        if self.config.expect is not None and count >= self.config.expect:
            ctx.complete()

    def progress_total(self) -> int | None:
        return self.config.expect

    def summary(self) -> dict[str, Any]:
        count = len(self.seen)
        return {
            "count": count,
            "correct": self.correct,
            "accuracy": self.correct / count if count else 0.0,
            "mean_reward": self.reward_sum / count if count else 0.0,
            "verifier_errors": self.errors,
            "redelivered": self.redelivered,
        }
