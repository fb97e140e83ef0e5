"""The learner's step journal: which groups each step consumed, written before its version
is published.

A checkpoint every step would make a resume exact but costs a full model and optimiser write
per step. Between checkpoints the journal (one small line per step, flushed to disk) records
what the published versions were trained on: a learner that restarts from an older checkpoint
takes the newest published version's weights and marks the journal's groups consumed, so no
published version is trained again under the same number with different weights, no step
repeats and no group is trained twice. What it cannot recover is the optimiser's moments of
those steps: they come from the checkpoint (exact with ``checkpoint_every: 1``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JournalEntry:
    """Step ``step`` (which publishes version ``step + 1``) consumed these groups."""

    step: int
    groups: dict[str, int]
    """Group id -> the version the dispatcher admitted it under (the ledger's version)."""


class StepJournal:
    """Append-only ``journal.jsonl`` beside the checkpoints; a torn last line is ignored."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, entry: JournalEntry) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": entry.step, "groups": entry.groups}) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def entries(self, first_step: int, end_step: int) -> list[JournalEntry] | None:
        """The entries of steps ``first_step .. end_step - 1``, or None if one is missing."""
        found: dict[int, JournalEntry] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    raw = json.loads(line)
                    groups = {str(k): int(v) for k, v in raw["groups"].items()}
                    entry = JournalEntry(int(raw["step"]), groups)
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # a line torn by the crash
                found[entry.step] = entry
        wanted = range(first_step, end_step)
        if any(s not in found for s in wanted):
            return None
        return [found[s] for s in wanted]


__all__ = ["JournalEntry", "StepJournal"]
