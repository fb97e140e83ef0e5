"""The EDF admission rule of the staleness ledger."""

from __future__ import annotations

import pytest

from dora.events import Ledger
from dora.rollout.staleness import StalenessLedger


def ledger(k: int, b: int, step: int, **unconsumed: int) -> StalenessLedger:
    led = StalenessLedger(k, b, learner_step=step)
    for key, n in unconsumed.items():
        led.counts(int(key[1:])).dispatched = n
    return led


def areal(k: int, b: int, v: int, total_dispatched: int) -> int:
    return max(0, (k + v + 1) * b - total_dispatched)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_matches_areal_when_tag_is_current_and_b_consumed_per_step(k: int) -> None:
    b, step = 4, 3
    led = ledger(k, b, step, v3=5)
    # consumed exactly B per step for steps 0..2 (all of older versions)
    led.counts(0).dispatched = led.counts(0).consumed = 12
    assert led.capacity(3) == areal(k, b, 3, 12 + 5)


def test_lagging_tag_gets_less_than_areal() -> None:
    led = ledger(1, 4, 3, v3=2)
    led.counts(0).dispatched = led.counts(0).consumed = 12
    # version 2 groups have deadline 3: only step 3's slots are left for them
    assert led.capacity(2) == 4 - 0
    assert led.capacity(3) == 8 - 2
    led.counts(2).dispatched = 3
    assert led.capacity(2) == 1  # 3 of step 3's 4 slots are taken by version 2
    assert led.capacity(3) == 8 - 5


def test_newer_groups_bound_an_older_admission() -> None:
    # 8 groups of version 3 already fill steps 3..4 (K=1, B=4): a version-2 group would
    # push one of them past its deadline, so nothing is admissible for version 2.
    led = ledger(1, 4, 3, v3=8)
    assert led.capacity(2) == 0


def test_no_capacity_past_the_deadline() -> None:
    assert ledger(2, 4, 5).capacity(2) == 0
    assert ledger(2, 4, 5).capacity(3) == 4


def test_oversize_batch_is_accounted_exactly() -> None:
    led = ledger(1, 4, 2, v1=6)
    led.counts(1).consumed = 6  # the learner took 6 groups (urgent) in one step
    assert led.capacity(2) == 8


def test_event_keeps_open_versions_only() -> None:
    led = ledger(1, 2, 5, v1=2, v4=1, v5=3)
    led.counts(1).consumed = 2
    led.counts(4).finished = 1
    event = led.to_event()
    assert isinstance(event, Ledger)
    assert [c.version for c in event.versions] == [4, 5]
    assert event.versions[0].finished == 1 and event.batch_groups == 2


def test_bad_parameters_name_the_field() -> None:
    with pytest.raises(ValueError, match="batch_groups"):
        StalenessLedger(1, 0)
    with pytest.raises(ValueError, match="staleness_bound"):
        StalenessLedger(-1, 2)


def test_areal_over_admits_a_lagging_tag_edf_does_not() -> None:
    # K=1, B=2, learner at step 3 (consumed 6 groups), engines still serve version 2.
    led = ledger(1, 2, 3)
    led.counts(0).dispatched = led.counts(0).consumed = 6
    # AReaL counts capacity from the learner's version (3): 4 groups. Tagged 2, they are
    # due at step 3, which has only B = 2 slots: two would need an oversize batch.
    assert areal(1, 2, 3, 6) == 4
    assert led.capacity(2) == 2
