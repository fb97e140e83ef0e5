"""Per-step slash-named scalars to ``metrics.jsonl`` and TensorBoard.

One JSON object per line: ``{"step": s, "time": t, "values": {"loss/pg": ...}}``. On resume
from step ``s`` the lines of later steps (written by the crashed run, whose updates were lost)
are removed, and TensorBoard is opened with ``purge_step`` so its curves stay consistent.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends step records to ``<run_dir>/metrics.jsonl`` and (optionally) TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self._truncate_from(resume_step)
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step
            )
        self._fh = self.path.open("a", encoding="utf-8")

    def _truncate_from(self, step: int) -> None:
        """Drop records of steps >= ``step`` (the resumed run redoes them)."""
        if not self.path.is_file():
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) < step
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def has_step(self, step: int) -> bool:
        """A record of ``step`` is in the file."""
        return any(record["step"] == step for record in read_metrics(self.run_dir))

    def write(self, step: int, values: dict[str, float]) -> None:
        """Record one step (non-finite values are kept in JSON as null and skipped in TB)."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}
        record = {"step": step, "time": time.time(), "values": clean}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for name, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(name, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of ``metrics.jsonl`` (for reports and tests)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
