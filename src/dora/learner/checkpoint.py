"""Learner checkpoints: model (HF dir), optimiser + scheduler, learner state, RNG; atomic.

Exactly-once training across crashes. The learner holds every scored message *unacked* until
a checkpoint covers it, then acks. A checkpoint covers a message once the sample is either
consumed (its group id is in ``consumed_groups``, and the saved weights include its update)
or buffered (the full event is in ``buffered``). So:

- a crash before the checkpoint: the unacked messages are redelivered by the durable consumer
  and trained on again by the resumed learner, whose weights do not include them;
- a crash after it: acked messages never come back; buffered ones are restored from the
  checkpoint, and any redelivery of a covered sample is deduped against the consumed set.

The other choice (ack on receipt) would lose what arrived after the last checkpoint, because
the buffer lives in memory until then. Holding messages costs ``max_ack_pending`` room
(the service checkpoints early when it runs short) and heartbeats (``in_progress``) so the
server does not redeliver them while held.

Layout: ``<dir>/step_000012/{model/, trainer.pt, state.json, rng.pt}``; written to a temp
directory then renamed, and ``<dir>/latest`` (written by ``os.replace``) names the newest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from dora.events import ScoredTrajectory
from dora.models import CharTokenizer, LlamaModel, load_state_dict_into, read_state_dict
from dora.models import save_pretrained as save_model

log = structlog.get_logger(__name__)

LATEST = "latest"


@dataclass
class LearnerState:
    """What the learner must remember besides weights and optimiser."""

    step: int = 0
    consumed_groups: list[str] = field(default_factory=list)
    refused_groups: list[str] = field(default_factory=list)
    consumed_by_version: dict[int, int] = field(default_factory=dict)
    refused_by_version: dict[int, int] = field(default_factory=dict)
    buffered: list[ScoredTrajectory] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_groups": sorted(self.consumed_groups),
            "refused_groups": sorted(self.refused_groups),
            "consumed_by_version": {str(k): v for k, v in self.consumed_by_version.items()},
            "refused_by_version": {str(k): v for k, v in self.refused_by_version.items()},
            "buffered": [json.loads(s.model_dump_json()) for s in self.buffered],
            "counters": self.counters,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        return cls(
            step=int(data["step"]),
            consumed_groups=list(data.get("consumed_groups", [])),
            refused_groups=list(data.get("refused_groups", [])),
            consumed_by_version={int(k): v for k, v in data.get("consumed_by_version", {}).items()},
            refused_by_version={int(k): v for k, v in data.get("refused_by_version", {}).items()},
            buffered=[
                ScoredTrajectory.model_validate_json(json.dumps(s))
                for s in data.get("buffered", [])
            ],
            counters=dict(data.get("counters", {})),
        )


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Writes and finds learner checkpoints under one directory."""

    def __init__(self, directory: Path, keep: int | None = 3) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def save(
        self,
        model: LlamaModel,
        trainer_state: dict[str, Any],
        state: LearnerState,
        tokenizer: CharTokenizer | None = None,
    ) -> Path:
        """Write one checkpoint atomically; returns its directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"step_{state.step:06d}"
        tmp = self.directory / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_model(model, tmp / "model", tokenizer)
            torch.save(trainer_state, tmp / "trainer.pt")
            torch.save(_rng_state(), tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(state.to_json()))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        pointer = self.directory / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.directory / LATEST)
        log.info("learner_checkpoint_saved", path=str(final), step=state.step)
        self._prune()
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.directory / LATEST
        if not pointer.is_file():
            return None
        path = self.directory / pointer.read_text().strip()
        return path if (path / "state.json").is_file() else None

    def load(
        self, model: LlamaModel, path: Path | None = None, restore_rng: bool = True
    ) -> tuple[dict[str, Any], LearnerState]:
        """Load weights into ``model``; returns (trainer state, learner state)."""
        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"no learner checkpoint in {self.directory}")
        load_state_dict_into(model, read_state_dict(path / "model"))
        trainer_state = torch.load(path / "trainer.pt", weights_only=False)
        if restore_rng:
            _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        state = LearnerState.from_json(json.loads((path / "state.json").read_text()))
        log.info("learner_checkpoint_loaded", path=str(path), step=state.step)
        return trainer_state, state

    def _prune(self) -> None:
        if self.keep is None:
            return
        steps = sorted(p for p in self.directory.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
