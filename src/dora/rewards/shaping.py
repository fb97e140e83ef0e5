"""DAPO overlong reward shaping: a soft, linear penalty near the length limit.

``reward -= factor * clip((length - (max_length - buffer)) / buffer, 0, 1)`` — responses
shorter than ``max_length - buffer`` are untouched, and the penalty reaches ``factor`` at
``max_length``. It discourages truncation without the noise of a hard cut-off.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OverlongShaping(BaseModel):
    """Parameters of the overlong penalty (lengths in tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: int = Field(gt=0, description="L_max: the generation limit.")
    buffer: int = Field(gt=0, description="Width of the penalty ramp before L_max.")
    factor: float = Field(default=1.0, ge=0.0, description="Penalty at L_max.")

    @model_validator(mode="after")
    def _fits(self) -> OverlongShaping:
        if self.buffer > self.max_length:
            raise ValueError(f"buffer ({self.buffer}) > max_length ({self.max_length})")
        return self

    def penalty(self, length: int) -> float:
        """The amount subtracted from the reward of a response of ``length`` tokens."""
        ramp = (length - (self.max_length - self.buffer)) / self.buffer
        return self.factor * min(max(ramp, 0.0), 1.0)

    def apply(self, reward: float, length: int) -> tuple[float, dict[str, float | int]]:
        """Shaped reward and the details to record."""
        p = self.penalty(length)
        return reward - p, {"overlong_penalty": p, "length": length, "raw_reward": reward}
