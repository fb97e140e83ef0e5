"""Where a stage's model comes from: a checkpoint directory, or the (cached) warm start.

Every stage of a run that needs the policy (engines, learner, evaluation) resolves the same
``ModelSource`` to the same directory, so version 0 is identical everywhere.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from dora.training.warmstart import WarmstartConfig, warmstart


class ModelSource(BaseModel):
    """``path`` to a HF checkpoint directory, or a ``warmstart`` config (trained and cached)."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = None
    warmstart: WarmstartConfig | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.warmstart is None):
            raise ValueError("model: give exactly one of 'path' or 'warmstart'")
        if self.path is not None and not (self.path / "config.json").is_file():
            raise ValueError(f"model.path: {self.path} has no config.json")
        return self

    def resolve(self, progress: bool = True) -> Path:
        """The checkpoint directory (trains the warm start once if it is not cached yet)."""
        if self.path is not None:
            return self.path
        assert self.warmstart is not None
        return warmstart(self.warmstart, progress=progress)
