"""What one live run did, from its recorded events and the learner's metrics only.

``dora bench modes --task`` compares modes on these numbers; they come from the run folder
(``events/*.jsonl``, ``metrics.jsonl``), as an outside reviewer would compute them:

- generated tokens/s: completion tokens of every trajectory over the run's wall time;
- trained tokens/s: tokens the learner trained on (``tokens/processed``) over the wall time;
- step time: the mean gap between learner steps; learner wait: the share of the run the
  learner spent waiting for data (the gaps minus its own step compute, ``time/step_s``);
- engine utilization: the share of status samples in which an engine ran something;
- migrations, re-prefilled tokens: from the migration records and the trajectories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dora.report.derive import summarize
from dora.report.load import load_run


def run_stats(run_dir: Path) -> dict[str, Any]:
    """The comparison numbers of one finished run (see the module docstring)."""
    run = load_run(Path(run_dir))
    steps = sorted(run.file_metrics, key=lambda m: m.step)
    if not steps or not run.trajectories:
        raise ValueError(f"{run_dir}: no learner steps or no trajectories recorded")
    start = min(t.dispatched_at for t in run.trajectories if t.dispatched_at) or run.t0
    wall = max(steps[-1].time - start, 1e-9)
    times = [start] + [m.time for m in steps]
    gaps = np.diff(times)
    compute = np.array([m.values.get("time/step_s", 0.0) for m in steps])
    wait = np.clip(gaps - compute, 0.0, None)
    busy = [s.running > 0 for s in run.status if s.state != "stopped"]
    summary = summarize(run)
    return {
        "wall_s": round(wall, 2),
        "steps": len(steps),
        "generated_tok_s": round(sum(t.completion_tokens for t in run.trajectories) / wall, 1),
        "trained_tok_s": round(sum(m.values.get("tokens/processed", 0.0) for m in steps) / wall, 1),
        "step_s": round(float(gaps.mean()), 3),
        "learner_wait_frac": round(float(wait.sum() / wall), 3),
        "utilization": round(float(np.mean(busy)), 3) if busy else float("nan"),
        "migrations": summary.migrations_ok,
        "reprefilled_tokens": summary.reprefilled_tokens,
        "trajectories": summary.trajectories,
    }
