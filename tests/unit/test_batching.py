"""Group assembly and staleness-aware batch selection, with hand-built groups."""

from __future__ import annotations

import math

import pytest

from dora.events import Ledger, VersionCounts
from dora.learner.batching import (
    AddOutcome,
    BatchSelector,
    GroupBuffer,
    InvalidTrajectory,
)
from dora.learner.synthetic import make_scored


def add_group(
    buf: GroupBuffer, gid: str, version: int, size: int = 2, *, step: int = 0, now: float = 0.0
) -> list[AddOutcome]:
    return [
        buf.add(
            make_scored(group_id=gid, group_index=i, group_size=size, version=version, reward=i),
            step=step,
            now=now,
        )
        for i in range(size)
    ]


def ledger(k: int, b: int, step: int, dispatched: dict[int, int]) -> Ledger:
    return Ledger(
        learner_step=step,
        staleness_bound=k,
        batch_groups=b,
        versions=tuple(VersionCounts(version=v, dispatched=n) for v, n in dispatched.items()),
    )


def test_group_completes_when_all_samples_arrive_in_any_order() -> None:
    buf = GroupBuffer(staleness_bound=2)
    samples = [make_scored(group_id="g", group_index=i, group_size=3, reward=i) for i in range(3)]
    assert buf.add(samples[2], step=0) is AddOutcome.BUFFERED
    assert buf.add(samples[0], step=0) is AddOutcome.BUFFERED
    assert "g" in buf.partial and not buf.ready
    assert buf.add(samples[1], step=0) is AddOutcome.COMPLETED
    group = buf.ready["g"]
    assert [s.trajectory.request.group_index for s in group.samples] == [0, 1, 2]
    assert group.rewards == [0.0, 1.0, 2.0]


def test_duplicates_by_request_id_are_ignored_and_counted() -> None:
    buf = GroupBuffer(staleness_bound=2)
    first = make_scored(group_id="g", group_index=0, group_size=2)
    assert buf.add(first, step=0) is AddOutcome.BUFFERED
    assert buf.add(first, step=0) is AddOutcome.DUPLICATE  # redelivery
    assert buf.add(first.model_copy(update={"event_id": "other"}), step=0) is AddOutcome.DUPLICATE
    assert buf.add(make_scored(group_id="g", group_index=1, group_size=2), step=0) is (
        AddOutcome.COMPLETED
    )
    buf.mark_consumed([buf.ready["g"]])
    assert buf.add(first, step=1) is AddOutcome.DUPLICATE  # after consumption
    assert buf.duplicates == 3
    assert buf.received == 5
    assert not buf.partial and not buf.ready


def test_selects_oldest_version_first() -> None:
    buf = GroupBuffer(staleness_bound=2)
    for gid, version, now in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        add_group(buf, gid, version, step=2, now=now)
    batch = BatchSelector(buf, batch_groups=2).select(2, None)
    assert batch is not None
    assert [g.group_id for g in batch.groups] == ["b", "d"]
    assert batch.staleness() == [2, 2]


def test_waits_for_fewer_than_b_groups() -> None:
    buf = GroupBuffer(staleness_bound=2)
    add_group(buf, "a", 0)
    assert BatchSelector(buf, batch_groups=2).select(0, None) is None


def test_waits_for_urgent_group_and_records_wait() -> None:
    k, b = 2, 2
    buf = GroupBuffer(staleness_bound=k)
    sel = BatchSelector(buf, batch_groups=b)
    add_group(buf, "old1", 0, step=2)
    add_group(buf, "new1", 1, step=2)
    add_group(buf, "new2", 1, step=2)
    # version 0 dispatched 2 groups, the learner has 1: step 2 = 0 + K is its last chance
    led = ledger(k, b, 2, {0: 2, 1: 2})
    assert sel.urgent_missing(2, led) == {0: 1}
    assert sel.select(2, led, now=10.0) is None
    assert sel.select(2, led, now=11.0) is None
    add_group(buf, "old2", 0, step=2, now=11.5)
    batch = sel.select(2, led, now=11.5)
    assert batch is not None
    assert [g.group_id for g in batch.groups] == ["old1", "old2"]
    assert batch.wait_s == pytest.approx(1.5)
    assert batch.urgent == 2


def test_no_wait_for_groups_that_are_not_urgent_yet() -> None:
    buf = GroupBuffer(staleness_bound=2)
    sel = BatchSelector(buf, batch_groups=1)
    add_group(buf, "a", 1, step=1)
    # K=2 at step 1: v0 is urgent at step 2 and v1 at step 3, so the 4 missing v1 groups
    # and the unfinished v0 group do not hold step 1 back
    led = ledger(2, 1, 1, {0: 2, 1: 5})
    add_group(buf, "v0", 0, step=1)
    batch = sel.select(1, led)
    assert batch is not None and batch.wait_s == 0.0
    assert [g.group_id for g in batch.groups] == ["v0"]


def test_all_urgent_groups_go_into_the_batch_even_beyond_b() -> None:
    buf = GroupBuffer(staleness_bound=1)
    sel = BatchSelector(buf, batch_groups=2)
    for gid in ("u1", "u2", "u3"):
        add_group(buf, gid, 0, step=1)
    add_group(buf, "fresh", 1, step=1)
    batch = sel.select(1, None)
    assert batch is not None
    assert sorted(g.group_id for g in batch.groups) == ["u1", "u2", "u3"]
    assert sel.oversize_batches == 1


def test_too_stale_group_is_refused_never_trained() -> None:
    buf = GroupBuffer(staleness_bound=2)
    outcomes = add_group(buf, "late", 2, step=5)
    assert outcomes == [AddOutcome.BUFFERED, AddOutcome.REFUSED]
    assert "late" in buf.refused and "late" not in buf.ready
    assert [g.group_id for g in buf.newly_refused] == ["late"]
    assert buf.refused_by_version[2] == 1
    # a redelivered sample of a refused group is a duplicate, not a new group
    again = make_scored(group_id="late", group_index=0, group_size=2, version=2)
    assert buf.add(again, step=5) is AddOutcome.DUPLICATE


def test_expire_stale_refuses_ready_groups_past_the_bound() -> None:
    buf = GroupBuffer(staleness_bound=1)
    add_group(buf, "a", 0, step=0)
    add_group(buf, "b", 1, step=0)
    assert [g.group_id for g in buf.expire_stale(2)] == ["a"]
    assert list(buf.ready) == ["b"]


def test_known_complete_counts_ready_consumed_and_refused() -> None:
    buf = GroupBuffer(staleness_bound=0)
    add_group(buf, "a", 0)
    add_group(buf, "b", 0)
    buf.mark_consumed([buf.ready["a"]])
    add_group(buf, "c", 0, step=1)  # refused (staleness 1 > 0)
    assert buf.known_complete(0) == 3


def test_invalid_samples_name_the_field() -> None:
    buf = GroupBuffer(staleness_bound=2)
    bad = make_scored(group_id="g", group_index=0, group_size=2, logprobs=[-1.0])
    with pytest.raises(InvalidTrajectory, match="logprobs"):
        buf.add(bad, step=0)
    bad_mask = make_scored(group_id="g", group_index=0, group_size=2, loss_mask=[1, 1, 1])
    with pytest.raises(InvalidTrajectory, match="loss_mask"):
        buf.add(bad_mask, step=0)
    buf.add(make_scored(group_id="g", group_index=0, group_size=2), step=0)
    with pytest.raises(InvalidTrajectory, match="group_size"):
        buf.add(make_scored(group_id="g", group_index=1, group_size=3), step=0)
    with pytest.raises(InvalidTrajectory, match="group_index"):
        buf.add(make_scored(group_id="h", group_index=3, group_size=2), step=0)
    for reward in (math.inf, -math.inf, math.nan):
        with pytest.raises(InvalidTrajectory, match="not a finite number"):
            buf.add(make_scored(group_id="r", group_index=0, group_size=2, reward=reward), step=0)
    for logprob in (math.nan, -math.inf, 0.5):
        bad_lp = make_scored(group_id="l", group_index=0, group_size=2, logprobs=[logprob, -1.0])
        with pytest.raises(InvalidTrajectory, match="finite log <= 0"):
            buf.add(bad_lp, step=0)


def test_urgent_wait_can_time_out() -> None:
    buf = GroupBuffer(staleness_bound=0)
    sel = BatchSelector(buf, batch_groups=1, max_urgent_wait_s=5.0)
    add_group(buf, "a", 0)
    led = ledger(0, 1, 0, {0: 2})
    assert sel.select(0, led, now=0.0) is None
    assert sel.select(0, led, now=4.9) is None
    batch = sel.select(0, led, now=5.0)
    assert batch is not None and batch.wait_s == 5.0
    assert sel.wait_timeouts == 1


def test_mixed_versions_count_as_the_oldest_tokens() -> None:
    """Partial-rollout baseline: resumed samples carry per-token versions."""
    buf = GroupBuffer(staleness_bound=2)
    resumed = make_scored(group_id="g", group_index=0, group_size=2, version=3)
    traj = resumed.trajectory.model_copy(update={"token_versions": (1, 3)})
    buf.add(resumed.model_copy(update={"trajectory": traj}), step=3)
    buf.add(make_scored(group_id="g", group_index=1, group_size=2, version=3), step=3)
    assert buf.ready["g"].version == 1
    assert buf.mixed_version_groups == {"g"}


def test_samples_the_model_cannot_take_are_invalid() -> None:
    buf = GroupBuffer(staleness_bound=2, max_seq_len=4, vocab_size=50)
    too_long = make_scored(group_id="g", group_index=0, group_size=2, completion_ids=[5, 6, 7])
    with pytest.raises(InvalidTrajectory, match="max_position_embeddings"):
        buf.add(too_long, step=0)
    bad_id = make_scored(group_id="g", group_index=0, group_size=2, completion_ids=[99])
    with pytest.raises(InvalidTrajectory, match="completion_token_ids"):
        buf.add(bad_id, step=0)


def test_retagged_groups_count_under_their_admitted_version() -> None:
    """Partial baseline: a group admitted under v1 but retagged to v3 before it generated
    anything has only v3 tokens. The learner must still count it against the ledger's v1
    entry, or ``urgent_missing`` never empties and step 3 waits forever (the live deadlock)."""
    k = 2
    buf = GroupBuffer(staleness_bound=k)
    sel = BatchSelector(buf, batch_groups=1)
    led = ledger(k, 1, 3, {1: 1, 3: 1})
    for i in range(2):
        sample = make_scored(group_id="g", group_index=i, group_size=2, version=3)
        request = sample.trajectory.request.model_copy(update={"admitted_version": 1})
        traj = sample.trajectory.model_copy(update={"request": request})
        buf.add(sample.model_copy(update={"trajectory": traj}), step=3)
    group = buf.ready["g"]
    assert (group.version, group.ledger_version) == (3, 1)  # staleness 0, ledger entry v1
    assert sel.urgent_missing(3, led) == {}
    batch = sel.select(3, led)
    assert batch is not None and batch.staleness() == [0]
    buf.mark_consumed(batch.groups)
    assert buf.consumed_by_version == {1: 1}


def test_an_abandoned_group_is_not_waited_for_and_never_trained() -> None:
    """The dispatcher abandoned ``old2`` (an engine refused one of its requests): the learner
    stops waiting for it at its deadline, drops the sample it held and ignores later ones."""
    k, b = 2, 2
    buf = GroupBuffer(staleness_bound=k)
    sel = BatchSelector(buf, batch_groups=b)
    add_group(buf, "old1", 0, step=2)
    add_group(buf, "new1", 1, step=2)
    buf.add(make_scored(group_id="old2", group_index=0, group_size=2, version=0), step=2)
    counts = (VersionCounts(version=0, dispatched=2), VersionCounts(version=1, dispatched=1))
    waiting = Ledger(learner_step=2, staleness_bound=k, batch_groups=b, versions=counts)
    assert sel.urgent_missing(2, waiting) == {0: 1} and sel.select(2, waiting, now=0.0) is None

    settled = (counts[0].model_copy(update={"abandoned": 1}), counts[1])
    led = waiting.model_copy(update={"versions": settled, "abandoned_groups": ("old2",)})
    assert buf.abandon(led.abandoned_groups) == 1 and "old2" not in buf.partial
    assert buf.abandon(led.abandoned_groups) == 0  # the ledger is read again and again
    late = make_scored(group_id="old2", group_index=1, group_size=2, version=0)
    assert buf.add(late, step=2) is AddOutcome.ABANDONED
    assert sel.urgent_missing(2, led) == {}
    batch = sel.select(2, led, now=1.0)
    assert batch is not None and [g.group_id for g in batch.groups] == ["old1", "new1"]
    assert "old2" not in {s.trajectory.request.group_id for s in buf.buffered_events()}
