"""Engine utilization of a recorded run: the union of each engine's request spans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dora.bench.run_stats import busy_fraction


def traj(engines: tuple[str, ...], started: float, finished: float) -> SimpleNamespace:
    return SimpleNamespace(engines=engines, started_at=started, finished_at=finished)


def test_overlapping_requests_count_once_and_idle_engines_count() -> None:
    trajs = [traj(("e0",), 10.0, 14.0), traj(("e0",), 12.0, 16.0), traj(("e0",), 18.0, 20.0)]
    # e0 busy 10-16 and 18-20 = 8 s of a 10 s window; e1 idle the whole window
    assert busy_fraction(trajs, 10.0, 20.0) == pytest.approx(0.8)
    assert busy_fraction(trajs, 10.0, 20.0, {"e0", "e1"}) == pytest.approx(0.4)


def test_migrated_span_is_split_and_clipped_to_the_window() -> None:
    trajs = [traj(("e0", "e1"), 100.0, 108.0)]  # e0 100-104, e1 104-108; window 102-108
    assert busy_fraction(trajs, 102.0, 108.0) == pytest.approx((2.0 + 4.0) / (2 * 6.0))


def test_a_trajectory_without_a_start_time_is_skipped() -> None:
    assert busy_fraction([traj(("e0",), 0.0, 5.0)], 0.0, 10.0, {"e0"}) == 0.0


def test_nothing_ran() -> None:
    assert busy_fraction([traj((), 0.0, 1.0)], 0.0, 1.0, {"e0"}) == 0.0
