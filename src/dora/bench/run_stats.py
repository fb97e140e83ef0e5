"""What one live run did, from its recorded events and the learner's metrics only.

``dora bench modes --task`` compares modes on these numbers; they come from the run folder
(``events/*.jsonl``, ``metrics.jsonl``), as an outside reviewer would compute them:

- generated tokens/s: completion tokens of every trajectory over the run's wall time;
- trained tokens/s: tokens the learner trained on (``tokens/processed``) over the wall time;
- step time: the mean gap between learner steps; learner wait: the share of the run the
  learner spent waiting for data (the gaps minus its own step compute, ``time/step_s``);
- engine utilization: the share of engine time (from the first dispatch to the last step) in
  which an engine held at least one running request, from the trajectories' start and finish
  times (a migrated trajectory's span is split evenly over the engines that decoded it; the
  0.5 s status samples missed whole steps of a short run);
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
    summary = summarize(run)
    engines = {s.engine_id for s in run.status}
    return {
        "wall_s": round(wall, 2),
        "steps": len(steps),
        "generated_tok_s": round(sum(t.completion_tokens for t in run.trajectories) / wall, 1),
        "trained_tok_s": round(sum(m.values.get("tokens/processed", 0.0) for m in steps) / wall, 1),
        "step_s": round(float(gaps.mean()), 3),
        "learner_wait_frac": round(float(wait.sum() / wall), 3),
        "utilization": round(busy_fraction(run.trajectories, start, start + wall, engines), 3),
        "migrations": summary.migrations_ok,
        "reprefilled_tokens": summary.reprefilled_tokens,
        "trajectories": summary.trajectories,
    }


def busy_fraction(
    trajectories: list[Any], start: float, end: float, engines: set[str] | None = None
) -> float:
    """Share of engine time in [start, end] in which an engine ran at least one request
    (``engines``: every engine of the run, idle ones included; default: those that decoded)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for t in trajectories:
        if not t.engines or t.finished_at <= t.started_at or not t.started_at:
            continue
        width = (t.finished_at - t.started_at) / len(t.engines)
        for i, engine in enumerate(t.engines):
            lo = max(start, t.started_at + i * width)
            hi = min(end, t.started_at + (i + 1) * width)
            if hi > lo:
                spans.setdefault(engine, []).append((lo, hi))
    if not spans or end <= start:
        return 0.0
    busy = 0.0
    for intervals in spans.values():
        intervals.sort()
        cur_lo, cur_hi = intervals[0]
        for lo, hi in intervals[1:]:
            if lo > cur_hi:
                busy += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        busy += cur_hi - cur_lo
    return busy / (len(set(spans) | set(engines or ())) * (end - start))
