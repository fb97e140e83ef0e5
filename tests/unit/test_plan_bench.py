"""First-fit packing against brute force, and the ``dora bench plan`` harness (no timing)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dora.bench.plan import measure, synthetic_fleet
from dora.rollout.actions import MigrateRequests
from dora.rollout.orchestrator import plan
from dora.rollout.packing import FirstFit


@settings(max_examples=200, deadline=None)
@given(
    bins=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=20),
    items=st.lists(st.integers(1, 40), max_size=30),
    off=st.integers(0, 19),
)
def test_first_fit_matches_a_linear_scan(bins, items, off) -> None:
    blocks = [b for b, _ in bins]
    seats = [s for _, s in bins]
    ff = FirstFit(blocks, seats)
    disabled = off % len(bins)
    ff.set_enabled(disabled, False)
    for size in items:
        expect = next(
            (i for i in range(len(bins)) if i != disabled and seats[i] > 0 and blocks[i] >= size),
            None,
        )
        assert ff.find(size) == expect
        if expect is not None:
            ff.take(expect, size)
            blocks[expect] -= size
            seats[expect] -= 1
    ff.set_enabled(disabled, True)
    if seats[disabled] > 0 and blocks[disabled] >= 1:
        assert ff.find(1) is not None


def test_synthetic_fleet_is_deterministic_and_plannable() -> None:
    a, b = synthetic_fleet(64, seed=3), synthetic_fleet(64, seed=3)
    assert a == b
    assert plan(a) == plan(b)
    assert any(isinstance(x, MigrateRequests) for x in plan(synthetic_fleet(128)))


def test_measure_rows_have_the_reported_columns(tmp_path) -> None:
    rows = measure((8, 64), repeats=3)
    assert [r["engines"] for r in rows] == [8, 64]
    for row in rows:
        assert row["actions"] <= 64 and row["median_ms"] > 0
        json.dumps(row)
